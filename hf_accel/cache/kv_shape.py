"""KVShape: a model's keys and values as a cache sees them, read from its config. The one place hf_accel checks
whether a model's layers can be cached.

Rules:
- caches serve decoder-only models: an encoder-decoder config raises `ValueError` naming the caller;
- layer kinds are transformers' (`get_layer_types_and_kwargs` of the decoder's text config); each caller names the
  kinds it can store, and any other kind raises `ValueError` listing both;
- `head_dim` is the config's `head_dim` when it is an int, else `hidden_size // num_attention_heads`; `kv_heads` is
  `num_key_value_heads` when set, else `num_attention_heads`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

FULL_AND_SLIDING = ("full_attention", "sliding_attention")
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def check_decoder_only(config: PreTrainedConfig, caller: str, argument: str = "config") -> None:
    """ValueError naming `caller` and `argument` when `config` is an encoder-decoder model's."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{caller} supports decoder-only models; `{argument}` is an encoder-decoder config")


def config_head_dim(config: PreTrainedConfig) -> int:
    """Channels per attention head of the decoder's layers."""
    text = config.get_text_config(decoder=True)
    size = getattr(text, "head_dim", None)
    return size if isinstance(size, int) else text.hidden_size // text.num_attention_heads


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token costs a cache: `num_layers` layers of `kv_heads` x `head_dim` keys and values; per layer its
    kind (`layer_types`, e.g. "sliding_attention") and the kwargs transformers builds its cache layer with."""

    num_layers: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] = ()
    layer_kwargs: tuple[dict, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_config(cls, config: PreTrainedConfig, supported: tuple[str, ...] = FULL_AND_SLIDING,
                    caller: str = "hf_accel", argument: str = "config") -> KVShape:
        """The shape of a decoder-only model's K/V; ValueError naming `caller` and `argument` for an encoder-decoder
        model or layer kinds outside `supported`."""
        check_decoder_only(config, caller, argument)
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        unsupported = sorted(set(layer_types) - set(supported))
        if unsupported:
            raise ValueError(f"{caller} supports layer types {supported}; this model's `{argument}` has {unsupported}")
        heads = text.num_attention_heads
        return cls(num_layers=len(layer_types), kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=config_head_dim(text), layer_types=tuple(layer_types), layer_kwargs=tuple(layer_kwargs))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.finfo(dtype).bits // 8

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per layer: its sliding window, or None for layers that keep every token (full and chunked attention)."""
        return [kwargs["sliding_window"] if kind == "sliding_attention" else None
                for kind, kwargs in zip(self.layer_types, self.layer_kwargs)]
