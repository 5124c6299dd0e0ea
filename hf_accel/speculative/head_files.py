"""How a drafter's trained head (an EAGLE head, Medusa heads) is stored: one folder holding its weights as
safetensors and its config, a dataclass, as JSON, under the file names the head's module gives."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def save_head(module: nn.Module, config: Any, folder: str | Path, weights_name: str, config_name: str) -> None:
    """Write `module`'s weights (`weights_name`) and its dataclass `config` (`config_name`) into `folder` (created if
    needed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in module.state_dict().items()}
    save_file(tensors, folder / weights_name, metadata={"format": "pt"})
    (folder / config_name).write_text(json.dumps(asdict(config), indent=2) + "\n")


def read_head(folder: str | Path, weights_name: str, config_name: str,
              device: str | torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config's fields and the weights (on `device`) that `save_head` wrote into `folder`; `FileNotFoundError`
    when it holds no config."""
    folder = Path(folder)
    if not (folder / config_name).is_file():
        raise FileNotFoundError(f"no {config_name} in {folder}")
    return json.loads((folder / config_name).read_text()), load_file(folder / weights_name, device=str(device))


def stored_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype the weights were stored in."""
    return next(iter(state.values())).dtype
