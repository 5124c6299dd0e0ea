"""A peft LoRA adapter folder read and checked against the base model: `adapter_config.json` and
`adapter_model.safetensors`, as peft's `save_pretrained` writes them.

Each adapted projection of the base gets `a` `[r, in]` and `b` `[out, r]` with the adapter's scaling folded into `b`
(`lora_alpha / r`, `lora_alpha / sqrt(r)` with rsLoRA, `alpha_pattern` per module), so the projection's update is
`x @ a.T @ b.T`: exactly peft's `scaling * lora_B(lora_A(x))`, and `merge_and_unload`'s `W + b @ a`. What peft can
save but this cannot serve unmerged is refused with a ValueError naming it: DoRA, trained biases, `modules_to_save`,
LoRA on embeddings or on the output layer, a rank above the engine's `max_lora_rank`, tensors whose shapes do not fit
the base's projections, and modules the base does not have.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")  # peft's saved key names


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's update per base projection (by the projection's module name): `a` `[r, in]`, `b` `[out, r]`
    (scaling folded in), both in the base's dtype on the CPU; `rank` is the largest `r` over its projections."""

    name: str
    path: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter(name: str, path: str | Path, projections: dict[str, tuple[int, int]], max_rank: int,
                 dtype: torch.dtype) -> AdapterWeights:
    """The adapter in folder `path` for a base whose adaptable projections are `projections` (module name ->
    `(in_features, out_features)`), as `dtype`; ValueError naming the adapter and what does not fit."""
    folder = Path(path)
    config = _read_config(name, folder)
    tensors = _read_tensors(name, folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if match is None:
            others.append(key)
        else:
            pairs.setdefault(match["module"], {})[match["part"]] = tensor
    if not pairs:
        raise ValueError(f"adapter {name!r}: {folder / WEIGHTS_FILE} holds no LoRA weights")
    modules = {module: _projection(name, module, pair, config, projections, max_rank, dtype)
               for module, pair in pairs.items()}
    if others:
        raise ValueError(f"adapter {name!r}: tensor {others[0]!r} is not a LoRA A / B weight (supported: peft "
                         "LoRA adapters on Linear projections, without biases or modules_to_save)")
    return AdapterWeights(name, str(folder), modules)


def _read_config(name: str, folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as error:
        raise ValueError(f"adapter {name!r}: no {CONFIG_FILE} in {folder}") from error
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"adapter {name!r}: {folder / CONFIG_FILE} cannot be read: {error}") from error
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    unsupported = {"use_dora": bool(config.get("use_dora")), "bias": config.get("bias", "none") != "none",
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out"))}
    refused = [key for key, present in unsupported.items() if present]
    if refused:
        raise ValueError(f"adapter {name!r}: {', '.join(refused)} cannot be served unmerged (merge the adapter "
                         "instead: peft's merge_and_unload)")
    return config


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"adapter {name!r}: no {WEIGHTS_FILE} in {folder} (peft's save_pretrained writes it)")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"adapter {name!r}: {path} cannot be read: {error}") from error


def _projection(name: str, module: str, pair: dict[str, torch.Tensor], config: dict,
                projections: dict[str, tuple[int, int]], max_rank: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`(a, b * scaling)` of one adapted module, checked against the base's projection."""
    if module not in projections:
        raise ValueError(f"adapter {name!r}: the base model has no adaptable Linear {module!r} (LoRA on "
                         "embeddings or the output layer cannot be served unmerged)")
    if set(pair) != {"A", "B"}:
        raise ValueError(f"adapter {name!r}: {module!r} has lora_{''.join(pair)} without its other half")
    a, b = pair["A"], pair["B"]
    in_features, out_features = projections[module]
    rank = a.shape[0] if a.dim() == 2 else 0
    if rank < 1 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
        raise ValueError(f"adapter {name!r}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                         f"which do not fit the base's Linear ({in_features} -> {out_features})")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} of {module!r} is over the engine's max_lora_rank "
                         f"({max_rank})")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous()


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """peft's rule for `alpha_pattern`: the first key that matches the end of the module's name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
