"""`hf_accel.json`: how `hf-accel serve --model FOLDER` serves a folder written by `hf-accel finetune`.

    {"quant": "int8", "medusa_heads": "medusa"}

`quant` is a weight preset name (`hf_accel.list_quantization_presets`) applied when the float model is loaded, or
null; `medusa_heads` is a folder of Medusa heads relative to the model folder, or null. A folder without the file
is served as a plain model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .quant.presets import PRESETS

CONFIG_NAME = "hf_accel.json"


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """What `hf-accel serve` applies to a model folder: a weight quantization preset and Medusa heads (a folder
    relative to the model folder)."""

    quant: str | None = None
    medusa_heads: str | None = None

    def __post_init__(self) -> None:
        names = [preset.name for preset in PRESETS]
        if self.quant is not None and self.quant not in names:
            raise ValueError(f"`quant` must be None or one of {names}, got {self.quant!r}")
        if self.medusa_heads is not None and Path(self.medusa_heads).is_absolute():
            raise ValueError(f"`medusa_heads` must be relative to the model folder, got {self.medusa_heads!r}")

    def heads_path(self, folder: str | Path) -> Path | None:
        """Where the heads of the model in `folder` are, or None when it has none."""
        return None if self.medusa_heads is None else Path(folder) / self.medusa_heads


def write_serving_config(folder: str | Path, config: ServingConfig) -> Path:
    """Write `folder/hf_accel.json`; returns its path."""
    path = Path(folder) / CONFIG_NAME
    path.write_text(json.dumps(asdict(config), indent=2) + "\n")
    return path


def read_serving_config(folder: str | Path) -> ServingConfig | None:
    """The `hf_accel.json` of model folder `folder`, or None when it has none (a hub id, a plain folder)."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    unknown = set(data) - {"quant", "medusa_heads"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: 'quant', 'medusa_heads'")
    return ServingConfig(**data)


__all__ = ["CONFIG_NAME", "ServingConfig", "read_serving_config", "write_serving_config"]
