"""Quantized KV cache: int8 / int4 / int2 codes plus a full-precision residual window, append-only (KIVI layout).

Per full-attention layer the cache holds

    sink_keys         [rows, kv_heads, Ts, D] in the model's dtype: the first `num_sink_columns` columns, unquantized
    quantized_keys    codes [rows, kv_heads, Tq, D * nbits / 8] uint8; scale, minimum [rows, kv_heads, Tq / G, 1, D]
    quantized_values  codes [rows, kv_heads, Tq, D * nbits / 8] uint8; scale, minimum [rows, kv_heads, Tq, D / G, 1]
    residual_keys     [rows, kv_heads, Tr, D] in the model's dtype (the most recent tokens); residual_values likewise

and shows, like every transformers layer, `keys` / `values` `[rows, kv_heads, Ts + Tq + Tr, D]`: the sinks, the
dequantized history, then the residual, computed when read (attention gets the same tensors from `update`; nothing
else builds them).

Sinks: each row's first `num_fp_sink_tokens` real tokens stay in full precision. Columns are shared by all rows (the
attention mask indexes them), so the cache keeps the first `num_fp_sink_tokens + largest left padding` columns of every
row: that covers each row's first real tokens after its own padding. Tokens go to the sinks until they are full, then
to the residual; a crop takes tokens back from the residual, then the quantized history, then the sinks.

Keys are grouped per channel over G tokens and values per token over G channels (KIVI). After an update has been
attended to in full precision, if the residual holds `residual_length` tokens or more, its whole groups are quantized
and appended (the residual then holds fewer than G tokens, so memory stays low right after a long prefill); quantized
data is never dequantized and re-quantized. The tokens of a short multi-token update (assisted decoding's candidates)
stay in full precision, so cropping rejected candidates is exact. Each forward dequantizes the quantized part into one
`[rows, kv_heads, Tq + Tr, D]` buffer (a fixed number of tensor ops per layer: no loop over tokens, no host sync).
Layers of other types (sliding windows, ...) are transformers' own dynamic layers.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin

from ..display import CacheDisplay
from ..quant import ops
from ..quant.ops import QuantizedTensor
from .kv_shape import KVShape
from .quantized_config import DEFAULT_FP_SINK_TOKENS, QuantizedKVConfig
from .row_layer import RowLayer, RowSelect
from .sink import leading_pad_counts

KEY_AXIS, VALUE_AXIS = -2, -1  # keys: groups of tokens per channel; values: groups of channels per token


class QuantizedKVLayer(RowLayer):
    """One full-attention layer: quantized history plus a full-precision residual window."""

    is_sliding = False
    is_croppable = True

    def __init__(self, settings: QuantizedKVConfig, num_sink_columns: int | None = None):
        # not CacheLayerMixin.__init__: it assigns `keys` / `values`, which are read-only views here
        self.is_initialized = False
        self.settings = settings
        # leading columns kept in full precision: the sinks plus the batch's largest left padding
        self.num_sink_columns = settings.num_fp_sink_tokens if num_sink_columns is None else num_sink_columns
        self.sink_keys: torch.Tensor | None = None  # [rows, kv_heads, Ts <= num_sink_columns, head_dim], model dtype
        self.sink_values: torch.Tensor | None = None
        self.quantized_keys: QuantizedTensor | None = None
        self.quantized_values: QuantizedTensor | None = None
        self.residual_keys: torch.Tensor | None = None  # [rows, kv_heads, Tr, head_dim], model dtype
        self.residual_values: torch.Tensor | None = None
        self.cumulative_length = 0

    @property
    def keys(self) -> torch.Tensor | None:
        """`[rows, kv_heads, seq_len, head_dim]`: the sinks, the dequantized history, then the residual (computed on
        access)."""
        return _history(self.sink_keys, self.quantized_keys, self.residual_keys)

    @property
    def values(self) -> torch.Tensor | None:
        """`[rows, kv_heads, seq_len, head_dim]`: the sinks, the dequantized history, then the residual (computed on
        access)."""
        return _history(self.sink_values, self.quantized_values, self.residual_values)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.settings = self.settings.for_head_dim(key_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        # new empty tensors, not views: an empty view would keep the whole first update's storage alive
        self.residual_keys, self.residual_values = _empty_like(key_states), _empty_like(value_states)
        self.sink_keys, self.sink_values = _empty_like(key_states), _empty_like(value_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[rows, kv_heads, q_len, head_dim]` states; return the layer's full K/V (sinks, dequantized history,
        residual)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        room = self.num_sink_columns - self.sink_keys.shape[-2]
        if room > 0:
            self.sink_keys = torch.cat((self.sink_keys, key_states[:, :, :room]), dim=-2)
            self.sink_values = torch.cat((self.sink_values, value_states[:, :, :room]), dim=-2)
            key_states, value_states = key_states[:, :, room:], value_states[:, :, room:]
        self.residual_keys = torch.cat((self.residual_keys, key_states), dim=-2)
        self.residual_values = torch.cat((self.residual_values, value_states), dim=-2)
        keys, values = self.keys, self.values
        if self.residual_keys.shape[-2] >= self.settings.residual_length:
            self._flush_residual(key_states.shape[-2])
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a non-positive count, as assisted decoding passes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        remove = min(-tokens_to_remove, self.cumulative_length)
        if remove == 0:
            return
        num_residual = self.residual_keys.shape[-2]
        num_quantized = 0 if self.quantized_keys is None else self.quantized_keys.num_tokens
        from_sinks = max(remove - num_residual - num_quantized, 0)
        if remove > num_residual and num_quantized:
            self._restore_groups(min(remove - num_residual, num_quantized))
        kept = self.residual_keys.shape[-2] - (remove - from_sinks)
        self.residual_keys, self.residual_values = self.residual_keys[:, :, :kept], self.residual_values[:, :, :kept]
        kept_sinks = self.sink_keys.shape[-2] - from_sinks  # later tokens refill the sinks first
        self.sink_keys, self.sink_values = self.sink_keys[:, :, :kept_sinks], self.sink_values[:, :, :kept_sinks]
        self.cumulative_length -= remove

    def reset(self) -> None:
        self.residual_keys = self.residual_values = self.sink_keys = self.sink_values = None
        self.quantized_keys = self.quantized_values = None
        self.cumulative_length = 0
        self.is_initialized = False

    def nbytes(self) -> int:
        """Bytes held: codes, scales and minima of the quantized part plus the full-precision sinks and residual."""
        if not self.is_initialized:
            return 0
        held = [self.sink_keys, self.sink_values, self.residual_keys, self.residual_values]
        quantized = sum(q.nbytes() for q in (self.quantized_keys, self.quantized_values) if q is not None)
        return quantized + sum(t.numel() * t.element_size() for t in held)

    def _flush_residual(self, latest: int) -> None:
        # Quantize the residual's oldest whole groups (keys need G tokens per group). The tokens of a multi-token
        # update shorter than the residual (assisted decoding's candidates) stay in full precision, so cropping the
        # rejected ones is exact; a decode step's token or a long prefill is flushed with the rest.
        size = self.settings.group_size
        keep = latest if 1 < latest < self.settings.residual_length else 0
        count = (self.residual_keys.shape[-2] - keep) // size * size
        if count == 0:
            return
        nbits = self.settings.nbits
        new_keys = ops.quantize(self.residual_keys[:, :, :count], nbits, size, KEY_AXIS)
        new_values = ops.quantize(self.residual_values[:, :, :count], nbits, size, VALUE_AXIS)
        self.quantized_keys = new_keys if self.quantized_keys is None else ops.concat(self.quantized_keys, new_keys)
        self.quantized_values = (
            new_values if self.quantized_values is None else ops.concat(self.quantized_values, new_values)
        )
        self.residual_keys = self.residual_keys[:, :, count:].clone()
        self.residual_values = self.residual_values[:, :, count:].clone()

    def _restore_groups(self, num_tokens: int) -> None:
        # A crop deeper than the latest update (never done by generate): move the last whole key groups covering
        # `num_tokens` back into the residual as their dequantized values (exactly what attention has been reading);
        # the caller slices. Survivors among them are quantized again at a later flush (the one re-quantization).
        size = self.settings.group_size
        groups = -(-num_tokens // size)
        keep = self.quantized_keys.num_tokens - groups * size
        restored_keys = ops.dequantize(_tokens(self.quantized_keys, slice(keep, None), slice(keep // size, None)))
        restored_values = ops.dequantize(_tokens(self.quantized_values, slice(keep, None), slice(keep, None)))
        self.residual_keys = torch.cat((restored_keys, self.residual_keys), dim=-2)
        self.residual_values = torch.cat((restored_values, self.residual_values), dim=-2)
        self.quantized_keys = _tokens(self.quantized_keys, slice(keep), slice(keep // size)) if keep else None
        self.quantized_values = _tokens(self.quantized_values, slice(keep), slice(keep)) if keep else None

    def _select_rows(self, select: RowSelect) -> None:
        if not self.is_initialized:
            return
        self.residual_keys, self.residual_values = select(self.residual_keys), select(self.residual_values)
        self.sink_keys, self.sink_values = select(self.sink_keys), select(self.sink_values)
        if self.quantized_keys is not None:
            self.quantized_keys = self.quantized_keys.map_tensors(select)
            self.quantized_values = self.quantized_values.map_tensors(select)


def _history(sinks: torch.Tensor | None, quantized: QuantizedTensor | None,
             residual: torch.Tensor | None) -> torch.Tensor | None:
    """`[rows, kv_heads, Ts + Tq + Tr, D]`: the full-precision `sinks`, `quantized` dequantized, then the full-precision
    `residual` (the residual itself while there is nothing else)."""
    if residual is None:
        return None
    if quantized is None:
        return residual if sinks.shape[-2] == 0 else torch.cat((sinks, residual), dim=-2)
    rows, heads, residual_len, head_dim = residual.shape
    start, end = sinks.shape[-2], sinks.shape[-2] + quantized.num_tokens
    out = torch.empty(rows, heads, end + residual_len, head_dim, dtype=residual.dtype, device=residual.device)
    out[:, :, :start].copy_(sinks)
    ops.dequantize(quantized, out[:, :, start:end])
    out[:, :, end:].copy_(residual)
    return out


def _empty_like(states: torch.Tensor) -> torch.Tensor:
    """`[rows, kv_heads, 0, head_dim]` of `states`' dtype and device."""
    return states.new_empty((*states.shape[:2], 0, states.shape[3]))


def _tokens(q: QuantizedTensor, tokens: slice, scale_rows: slice) -> QuantizedTensor:
    """A token range of `q`: `tokens` of the codes, `scale_rows` of scale and minimum (token groups for keys,
    tokens for values)."""
    return QuantizedTensor(q.codes[..., tokens, :], q.scale[..., scale_rows, :, :], q.minimum[..., scale_rows, :, :],
                           q.nbits, q.group_size, q.axis)


class QuantizedKVCache(CacheDisplay, Cache):
    """hf_accel's quantized KV cache; full-attention layers quantized, other layer types kept by transformers.

    Use through generate, `cache_implementation="quantized", cache_config={"backend": "hf_accel", "nbits": 4}`, or
    directly: `model.generate(..., past_key_values=QuantizedKVCache(model.config, nbits=4))`.

    Args:
        config: the model's config (its text config is used; encoder-decoder configs are refused).
        nbits: bits per K/V code, see `QuantizedKVConfig`.
        group_size: values sharing one scale and minimum, see `QuantizedKVConfig`; by default the largest power of
            two up to 64 that divides the model's head dimension.
        residual_length: recent tokens kept in full precision, see `QuantizedKVConfig`; by default the smallest
            multiple of the group size that is at least 128.
        num_fp_sink_tokens: each row's first real tokens kept in full precision, never quantized (default 4; 0:
            none), see `QuantizedKVConfig`.
        attention_mask: the prompts' 2-D padding mask `[rows, prompt_len]`, so that each row's sinks are its first
            real tokens after its left padding (the first `num_fp_sink_tokens + largest padding` columns are kept).
            `generate(cache_implementation="quantized", ...)` passes it; without it the cache assumes no left padding.
    """

    def __init__(self, config: PreTrainedConfig, nbits: int = 4, group_size: int | None = None,
                 residual_length: int | None = None, num_fp_sink_tokens: int = DEFAULT_FP_SINK_TOKENS,
                 attention_mask: torch.Tensor | None = None):
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(f"`config` must be a transformers PreTrainedConfig, got {type(config).__name__}")
        shape = KVShape.from_config(config, tuple(DYNAMIC_LAYER_TYPE_MAPPING), "QuantizedKVCache")
        settings = QuantizedKVConfig(nbits=nbits, group_size=group_size, residual_length=residual_length,
                                     num_fp_sink_tokens=num_fp_sink_tokens)
        self.settings = settings.for_head_dim(shape.head_dim)
        self.num_sink_columns = _sink_columns(num_fp_sink_tokens, attention_mask)
        layers = [
            QuantizedKVLayer(self.settings, self.num_sink_columns) if kind == "full_attention"
            else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
            for kind, kwargs in zip(shape.layer_types, shape.layer_kwargs)
        ]
        super().__init__(layers=layers)

    def memory_bytes(self) -> int:
        """Bytes of K/V held by all layers (codes, scales, minima, residuals and any full-precision layers)."""
        return sum(_layer_bytes(layer) for layer in self.layers)


def _sink_columns(num_fp_sink_tokens: int, attention_mask: torch.Tensor | None) -> int:
    """Leading columns to keep in full precision: `num_fp_sink_tokens` after the largest left padding of the mask."""
    if num_fp_sink_tokens == 0 or attention_mask is None:
        return num_fp_sink_tokens
    return num_fp_sink_tokens + int(leading_pad_counts(attention_mask).max())


def _layer_bytes(layer: CacheLayerMixin) -> int:
    if isinstance(layer, QuantizedKVLayer):
        return layer.nbytes()
    held = (getattr(layer, "keys", None), getattr(layer, "values", None))
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))

