"""Settings of the sink cache, validated once, shared by the constructor and `cache_config=` in generate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .settings import check_int, settings_from_dict


@dataclass(frozen=True, slots=True)
class SinkCacheConfig:
    """`window_length`: tokens kept per row, sinks included (as in transformers' former `SinkCache`);
    `num_sink_tokens`: the first real tokens of each row kept forever (0 gives a plain sliding window).
    The most recent `window_length - num_sink_tokens` tokens make up the rest of the window."""

    window_length: int = 1024
    num_sink_tokens: int = 4

    def __post_init__(self) -> None:
        check_int("window_length", self.window_length, 1, "a positive int")
        check_int("num_sink_tokens", self.num_sink_tokens, 0, "a non-negative int")
        if self.window_length <= self.num_sink_tokens:
            raise ValueError(
                f"`window_length` ({self.window_length}) must be greater than `num_sink_tokens` "
                f"({self.num_sink_tokens}): the window holds the sinks plus at least one recent token"
            )

    @property
    def num_recent_tokens(self) -> int:
        """Tokens of the window that slide: `window_length - num_sink_tokens`."""
        return self.window_length - self.num_sink_tokens

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> SinkCacheConfig:
        """Build from a `cache_config` dict, rejecting unknown keys by name."""
        return cls(**settings_from_dict(cls, options, "sink"))
