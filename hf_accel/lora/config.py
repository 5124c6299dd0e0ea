"""What a user writes to serve adapters, with vLLM's names: `LoRAConfig` (the engine's limits) and `LoRARequest` (the
adapter one request runs with)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters an engine serves at once.

    Args:
        max_loras: adapters resident in the step's stacked weights at once (the distinct adapters of one batch); a
            request whose adapter finds no free slot waits until one is released.
        max_lora_rank: the largest rank an adapter may have (the stacked weights' rank dimension).
        max_cpu_loras: adapters kept read in CPU memory (least recently used dropped first); at least `max_loras`.
    """

    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 32

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"`max_cpu_loras` ({self.max_cpu_loras}) must be at least `max_loras` "
                             f"({self.max_loras})")


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: a peft adapter folder (`adapter_config.json` and
    `adapter_model.safetensors`), known to the engine by `lora_int_id` (positive, one folder per id) and `lora_name`.

    Args:
        lora_name: the adapter's name (the model name a server request selects it by).
        lora_int_id: its id, at least 1; two requests with the same id share the adapter's weights and prefix cache.
        lora_path: the adapter folder.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str | Path

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"`lora_name` must be a non-empty str, got {self.lora_name!r}")
        _check_id(self.lora_int_id)
        if not isinstance(self.lora_path, (str, Path)):
            raise TypeError(f"`lora_path` must be a str or Path, got {type(self.lora_path).__name__}")


def check_lora_id(lora_int_id: int, adapters: object | None) -> None:
    """ValueError unless `lora_int_id` is an adapter id (an int of at least 1) of an engine serving adapters
    (`adapters` not None)."""
    _check_id(lora_int_id)
    if adapters is None:
        raise ValueError("this engine serves no LoRA adapters (build it with `lora=hf_accel.LoRAConfig(...)`)")


def _check_id(lora_int_id: int) -> None:
    if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
        raise ValueError(f"`lora_int_id` must be an int of at least 1, got {lora_int_id!r}")
