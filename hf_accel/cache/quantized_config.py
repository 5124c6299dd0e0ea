"""Settings of the quantized KV cache, validated once, without I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..quant.ops import SUPPORTED_NBITS
from .settings import check_int, settings_from_dict

BACKEND = "hf_accel"  # the `cache_config["backend"]` that selects this cache under cache_implementation="quantized"
MAX_DEFAULT_GROUP_SIZE = 64  # default group: the largest power of two up to this that divides the head dimension
DEFAULT_RESIDUAL_TOKENS = 128  # default residual: the smallest multiple of the group size at least this long
DEFAULT_FP_SINK_TOKENS = 4  # each row's first real tokens kept in full precision (StreamingLLM's 4 attention sinks)


@dataclass(frozen=True, slots=True)
class QuantizedKVConfig:
    """How K/V are quantized (KIVI layout).

    nbits: bits per code, one of 2, 4, 8. group_size: elements sharing a scale and minimum: keys are grouped per
    channel over `group_size` consecutive tokens, values per token over `group_size` consecutive channels (so it
    must divide the head dimension); None: the largest power of two up to 64 that divides the head dimension
    (64 for head dimension 128, 16 for 16). residual_length: the most recent tokens are kept in full precision; once
    that many have accumulated, the oldest whole groups of them are quantized and appended (a positive multiple of
    `group_size`); None: the smallest multiple of `group_size` that is at least 128. num_fp_sink_tokens: each row's
    first real tokens (after its left padding) are kept in full precision and never quantized (default 4, as
    StreamingLLM's attention sinks; 0 quantizes them like any token): models park attention on their first tokens,
    whose K/V are often huge outliers, so quantizing them costs far more quality than their bytes save.
    Defaults left as None are settled by `for_head_dim` once the model is known.
    """

    nbits: int = 4
    group_size: int | None = None
    residual_length: int | None = None
    num_fp_sink_tokens: int = DEFAULT_FP_SINK_TOKENS

    def __post_init__(self) -> None:
        check_int("nbits", self.nbits, 0, f"an int, one of {SUPPORTED_NBITS}")
        if self.nbits not in SUPPORTED_NBITS:
            raise ValueError(f"`nbits` must be one of {SUPPORTED_NBITS}, got {self.nbits}")
        if self.group_size is not None:
            check_int("group_size", self.group_size, 1, "a positive int or None (fit the head dimension)")
        if self.residual_length is not None:
            check_int("residual_length", self.residual_length, 1, "a positive multiple of `group_size` or None")
        check_int("num_fp_sink_tokens", self.num_fp_sink_tokens, 0, "a non-negative int")
        if self.group_size is not None and self.residual_length is not None and (
                self.residual_length < self.group_size or self.residual_length % self.group_size):
            raise ValueError(
                f"`residual_length` must be a positive multiple of `group_size` ({self.group_size}), "
                f"got {self.residual_length}"
            )

    def for_head_dim(self, head_dim: int) -> QuantizedKVConfig:
        """These settings with defaults fitted to `head_dim`; raises `ValueError` naming `group_size` (or `nbits`) when
        an explicit value does not fit."""
        group_size = self.group_size or math.gcd(MAX_DEFAULT_GROUP_SIZE, head_dim)
        residual_length = self.residual_length or -(-DEFAULT_RESIDUAL_TOKENS // group_size) * group_size
        settled = replace(self, group_size=group_size, residual_length=residual_length)
        settled.check_head_dim(head_dim)
        return settled

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if values cannot be grouped per token or codes cannot be packed for this head dimension."""
        assert self.group_size is not None, "settle the defaults with `for_head_dim` first"
        if head_dim % self.group_size:
            raise ValueError(f"`group_size` ({self.group_size}) must divide the model's head dimension ({head_dim})")
        per_byte = 8 // self.nbits
        if head_dim % per_byte:
            raise ValueError(
                f"`nbits`={self.nbits} packs {per_byte} codes per byte; head dimension {head_dim} is not a multiple"
            )

    @classmethod
    def from_dict(cls, cache_config: Mapping[str, Any] | None) -> QuantizedKVConfig:
        """From generate's `cache_config` (`backend` is accepted and must be "hf_accel"; `q_group_size`, the stock
        name, is accepted for `group_size`)."""
        settings = settings_from_dict(cls, cache_config, "hf_accel quantized", extra_keys=("backend", "q_group_size"))
        if settings.pop("backend", BACKEND) != BACKEND:
            raise ValueError(f"`cache_config['backend']` must be {BACKEND!r} for hf_accel's quantized cache")
        if "q_group_size" in settings:
            if "group_size" in settings:
                raise ValueError("give `group_size` or `q_group_size` (its stock name), not both")
            settings["group_size"] = settings.pop("q_group_size")
        return cls(**settings)
