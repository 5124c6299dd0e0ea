"""peft LoRA adapters exported beside the base for vLLM's multi-LoRA serving (targeted: vLLM 0.32, `--enable-lora`).

Each adapter folder is read and checked against the exported base by hf_accel's own reader
(`hf_accel.lora.adapter_files.read_adapter`: LoRA on the base's Linear projections only, A / B shapes that fit
them, no DoRA, trained biases or `modules_to_save`, a rank vLLM accepts), then its two files
(`adapter_config.json`, `adapter_model.safetensors`) are copied unchanged to `OUT/loras/NAME/`. The serve line gains

    --enable-lora --max-lora-rank R --max-loras N+1 --lora-modules NAME=OUT/loras/NAME ...

with R the largest adapter rank rounded up to a value of vLLM's `LoRAConfig.max_lora_rank` (`VLLM_LORA_RANKS`) and N
the number of adapters, so that all of them are resident at once, plus one slot kept empty: vLLM 0.32's CPU LoRA ops
(`vllm/lora/ops/torch_ops/lora_ops.py`, `lora_b_weights[lora_indices_tensor]`) index the stacked weights with a base
token's -1, that is the last slot, so in a step mixing base and adapter requests the base requests would run with
the last slot's adapter (benchmarks/check_vllm_lora.py measures it). vLLM fills the first free slot, so with N
adapters the last one stays zero. The request's `model` NAME selects the adapter, as in `hf-accel serve
--lora-modules`.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..lora.adapter_files import CONFIG_FILE, WEIGHTS_FILE, read_adapter
from ..lora.layers import adaptable_projections

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's `--max-lora-rank` choices, above 1
LORA_SUBDIR = "loras"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a folder name and a `model` name, without `=` or spaces


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest of `VLLM_LORA_RANKS` at least `rank`; `ValueError` when `rank` is over the largest."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"lora_modules: rank {rank} is over vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})")


@dataclass(frozen=True, slots=True)
class ExportedAdapter:
    """One adapter of an export: the `name` requests select it by, its source folder and its rank."""

    name: str
    source: Path
    rank: int

    @property
    def subdir(self) -> str:
        """Where the export holds it, relative to the export's folder."""
        return f"{LORA_SUBDIR}/{self.name}"


@dataclass(frozen=True, slots=True)
class LoRAModules:
    """The adapters an export carries and the `vllm serve` flags that serve them."""

    adapters: tuple[ExportedAdapter, ...]

    @classmethod
    def check(cls, lora_modules: Mapping[str, str | Path], model: nn.Module, served_model_name: str) -> LoRAModules:
        """`lora_modules` (name -> peft adapter folder) checked against the base `model`; `ValueError` naming
        `lora_modules`, the adapter and what does not fit."""
        if not isinstance(lora_modules, Mapping) or not lora_modules:
            raise ValueError(f"lora_modules must be a non-empty mapping of name -> adapter folder, got "
                             f"{lora_modules!r}")
        projections = {name: (m.in_features, m.out_features) for name, m in adaptable_projections(model).items()}
        adapters = []
        for name, path in lora_modules.items():
            _check_name(name, served_model_name)
            try:
                weights = read_adapter(name, path, projections, VLLM_LORA_RANKS[-1], torch.float32)
            except ValueError as error:
                raise ValueError(f"lora_modules: {error}") from None
            adapters.append(ExportedAdapter(name, Path(path), weights.rank))
        return cls(tuple(adapters))

    @property
    def max_loras(self) -> int:
        """vLLM's `--max-loras`: a slot per adapter and an empty last slot (for base tokens, see the module's doc)."""
        return len(self.adapters) + 1

    @property
    def max_lora_rank(self) -> int:
        """vLLM's `--max-lora-rank`: the largest adapter rank, rounded up to a value vLLM accepts."""
        return vllm_max_lora_rank(max(adapter.rank for adapter in self.adapters))

    def argv(self, folder: str) -> list[str]:
        """The `vllm serve` flags for the adapters of the export in `folder` (a path or a shell expression)."""
        modules = [f"{adapter.name}={folder}/{adapter.subdir}" for adapter in self.adapters]
        return ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras),
                "--lora-modules", *modules]

    def write(self, out: Path) -> list[tuple[str, str]]:
        """Copy each adapter's two files under `out`; (folder, description) of each, for the README."""
        written = []
        for adapter in self.adapters:
            target = out / adapter.subdir
            target.mkdir(parents=True, exist_ok=True)
            for file_name in (CONFIG_FILE, WEIGHTS_FILE):
                shutil.copyfile(adapter.source / file_name, target / file_name)
            written.append((adapter.subdir, f"the peft LoRA adapter `{adapter.name}` (rank {adapter.rank}), "
                                            f"served as `model: {adapter.name}`"))
        return written


def _check_name(name: object, served_model_name: str) -> None:
    if not isinstance(name, str) or NAME.match(name) is None:
        raise ValueError(f"lora_modules: adapter name {name!r} must be letters, digits, '.', '_' or '-' (it names a "
                         "folder and the `model` requests select it by)")
    if name == served_model_name:
        raise ValueError(f"lora_modules: adapter name {name!r} is the base's served model name; choose another")
