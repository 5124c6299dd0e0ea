"""Settings of the paged KV cache, validated once, shared by the constructor and `cache_config=` in generate."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .settings import check_int, settings_from_dict

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str, name: str = "max_memory") -> int:
    """`1048576`, `"512MiB"`, `"2GB"` -> bytes. Raises ValueError naming `name` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int number of bytes or a string such as '512MiB', got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*", value.lower())):
        number = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    else:
        raise ValueError(f"`{name}` must be an int number of bytes or a string such as '512MiB', got {value!r}")
    if number <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}")
    return number


@dataclass(slots=True)
class PagedCacheConfig:
    """`block_size`: tokens per block. `num_blocks` / `max_memory`: fix the pool size (blocks, or bytes for K and V of
    all layers); set at most one. With neither, the pool is sized from the request and grows when needed."""

    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | str | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1, "a positive int")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1, "a positive int or None")
        if self.max_memory is not None:
            self.max_memory = parse_bytes(self.max_memory)
        if self.num_blocks is not None and self.max_memory is not None:
            raise ValueError("Set at most one of `num_blocks` and `max_memory` in the paged cache config")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> PagedCacheConfig:
        """Build from a `cache_config` dict, rejecting unknown keys by name (`prefix_store` is allowed and left out:
        it is an object, not a setting)."""
        settings = settings_from_dict(cls, options, "paged", extra_keys=("prefix_store",))
        settings.pop("prefix_store", None)
        return cls(**settings)
