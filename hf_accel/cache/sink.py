"""SinkCache: a sliding window plus attention sinks (StreamingLLM), at constant memory, for the `generate` loop.

Columns are the token positions of the 2-D attention mask (left padding included); `seen` counts the columns a row
has been through, N = `window_length`, S = `num_sink_tokens`. When a step of q tokens starts, each row attends over
  - columns `seen - N .. seen - 1` (all of them while seen <= N), presented in that order, plus the q new ones;
  - except that once a row has more than N real tokens (`seen - N > pads`), the first S of those slots show the row's
    own first S real tokens (its sinks), re-rotated to sit right before the recent tokens.
`get_mask_sizes` reports exactly those columns (`kv_offset = max(seen - N, 0)`), so the padding mask and the causal
rule transformers builds line up with every slot. Keys stay at the positions RoPE gave them, except sinks, which move
by `delta = seen - N - pads` (one rotation of S keys per step): the query keeps its own position, and every distance
query -> key equals StreamingLLM's in-cache distance (docs/caches.md).

Storage per full-attention layer: a buffer `[rows, kv_heads, capacity, head_dim]` of consecutive columns (capacity
`window_length + slack`, allocated once; `update` returns a view of it) and the sinks as they arrived
`[rows, kv_heads, S, head_dim]`. Eviction is lazy (at the start of the next step), so `crop` can take back the last
step, as assisted decoding does. Sliding-window layers of hybrid models keep transformers' own sliding layer.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from ..display import CacheDisplay
from .rope import rope_inverse_frequencies, rotate
from .sink_config import SinkCacheConfig
from .sink_window import SinkStep, SinkWindow


class SinkLayer(CacheLayerMixin):
    """One full-attention layer's window buffer and sinks; executes the `SinkStep` its cache plans."""

    is_croppable = True
    is_sliding = False

    def __init__(self, window: SinkWindow):
        super().__init__()
        self.window = window

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, dim = key_states.shape
        # buffers: [rows, kv_heads, capacity, head_dim]; sinks: [rows, kv_heads, S, head_dim] at their own positions
        self.keys = key_states.new_zeros((rows, heads, 0, dim))
        self.values = value_states.new_zeros((rows, heads, 0, value_states.shape[3]))
        num_sinks = self.window.settings.num_sink_tokens
        self.sink_keys = key_states.new_zeros((rows, heads, num_sinks, dim))
        self.sink_values = value_states.new_zeros((rows, heads, num_sinks, value_states.shape[3]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: SinkStep, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[rows, kv_heads, q, head_dim]` states; return the `[rows, kv_heads, kv_length, head_dim]` K/V of the
        columns `get_mask_sizes` reported (new tokens last)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.shape[2] < step.capacity:
            self.grow(step.capacity)
        if step.capture_index is not None:
            self.capture_sinks(key_states, value_states, step)
        if step.compact is not None:
            source, length = step.compact
            self.keys[:, :, :length] = self.keys[:, :, source : source + length].clone()
            self.values[:, :, :length] = self.values[:, :, source : source + length].clone()
        if step.show_sinks:
            self.show_sinks(step)
        if step.overflow:
            return self.concatenate(key_states, value_states, step)
        end = step.write_slot + step.num_new
        self.keys[:, :, step.write_slot : end] = key_states
        self.values[:, :, step.write_slot : end] = value_states
        return self.keys[:, :, step.read_slot : end], self.values[:, :, step.read_slot : end]

    def grow(self, capacity: int) -> None:
        extra = capacity - self.keys.shape[2]
        self.keys = torch.cat([self.keys, self.keys.new_zeros((*self.keys.shape[:2], extra, self.keys.shape[3]))], 2)
        self.values = torch.cat(
            [self.values, self.values.new_zeros((*self.values.shape[:2], extra, self.values.shape[3]))], 2)

    def capture_sinks(self, key_states: torch.Tensor, value_states: torch.Tensor, step: SinkStep) -> None:
        """Keep the new tokens that are some row's sinks: sink i of row r is this step's token `capture_index[r, i]`
        where `capture_valid[r, i]`."""
        valid = step.capture_valid[:, None, :, None]
        index = step.capture_index[:, None, :, None]
        keys = key_states.gather(2, index.expand(-1, key_states.shape[1], -1, key_states.shape[3]))
        values = value_states.gather(2, index.expand(-1, value_states.shape[1], -1, value_states.shape[3]))
        self.sink_keys = torch.where(valid, keys, self.sink_keys)
        self.sink_values = torch.where(valid, values, self.sink_values)

    def show_sinks(self, step: SinkStep) -> None:
        """Put each row's sinks, moved by its `delta`, into the first S slots it returns (rows in `step.sink_rows`)."""
        region = slice(step.read_slot, step.read_slot + self.sink_keys.shape[2])
        keys = rotate(self.sink_keys, step.cos.to(self.sink_keys.device), step.sin.to(self.sink_keys.device))
        values = self.sink_values
        if step.sink_rows is not None:
            rows = step.sink_rows[:, None, None, None]
            keys = torch.where(rows, keys, self.keys[:, :, region])
            values = torch.where(rows, values, self.values[:, :, region])
        self.keys[:, :, region] = keys
        self.values[:, :, region] = values

    def concatenate(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: SinkStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step longer than the buffer (e.g. a long prompt): return all its K/V, keep the last `step.keep`."""
        cached = slice(step.read_slot, step.write_slot)
        keys, values = key_states, value_states
        if step.write_slot > step.read_slot:
            keys = torch.cat([self.keys[:, :, cached], key_states], dim=2)
            values = torch.cat([self.values[:, :, cached], value_states], dim=2)
        self.keys[:, :, : step.keep] = keys[:, :, -step.keep :]
        self.values[:, :, : step.keep] = values[:, :, -step.keep :]
        return keys, values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            index = beam_idx.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
            self.sink_keys = self.sink_keys.index_select(0, index)
            self.sink_values = self.sink_values.index_select(0, index)

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window.mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.window.num_seen

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.nbytes for t in (self.keys, self.values, self.sink_keys, self.sink_values))


class SinkCache(CacheDisplay, Cache):
    """Sliding window of `window_length` tokens per row, the first `num_sink_tokens` of them the row's first real
    tokens (attention sinks), at constant memory: generation can run past `max_position_embeddings`.

    Args:
        config: the model config: decoder-only, with RoPE of fixed frequencies and at least one full-attention layer
            (sliding-window layers of hybrid models keep the model's own window).
        window_length: tokens kept per row, sinks included.
        num_sink_tokens: first real tokens of each row kept forever (0: a plain sliding window).
        attention_mask: the prompts' 2-D padding mask `[rows, prompt_len]`, so that pad tokens never become sinks.
            `generate(cache_implementation="sink")` passes it; without it the cache assumes no left padding.
        max_cache_len: expected tokens per row, to size the buffer below `window_length` for short requests.

    Example: `model.generate(**inputs, past_key_values=SinkCache(model.config, window_length=1024,
    num_sink_tokens=4, attention_mask=inputs["attention_mask"]))`.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        window_length: int = 1024,
        num_sink_tokens: int = 4,
        attention_mask: torch.Tensor | None = None,
        max_cache_len: int | None = None,
    ):
        self.settings = SinkCacheConfig(window_length=window_length, num_sink_tokens=num_sink_tokens)
        layer_types, layer_kwargs = _checked_layer_types(config)
        pad_counts = None if attention_mask is None else leading_pad_counts(attention_mask)
        inv_freq = rope_inverse_frequencies(config, "full_attention")
        self.window = SinkWindow(self.settings, inv_freq, pad_counts, max_cache_len)
        super().__init__(layers=[
            SinkLayer(self.window) if kind == "full_attention" else DynamicSlidingWindowLayer(**kwargs)
            for kind, kwargs in zip(layer_types, layer_kwargs)
        ])
        self.first_sink_layer = layer_types.index("full_attention")
        self._step: SinkStep | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[rows, kv_heads, q, head_dim]` states of `layer_idx`; return the K/V its attention reads."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, SinkLayer):
            return layer.update(key_states, value_states)
        if layer_idx == self.first_sink_layer:
            self._step = self.window.plan(key_states.shape[2], key_states.shape[0], key_states.device)
        return layer.update(key_states, value_states, self._step)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a non-positive count, as assisted decoding passes); raises
        `ValueError` when that would need evicted tokens back."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        self.window.crop(-tokens_to_remove)  # sink layers keep their tensors: only the column count moves back
        for layer in self.layers:
            if not isinstance(layer, SinkLayer):
                layer.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.window.select_rows(beam_idx)
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reorder_cache(torch.arange(self.window.num_rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices))

    def reset(self) -> None:
        """Drop every token (and the padding the cache was built for)."""
        self.window.reset()
        super().reset()

    def memory_bytes(self) -> int:
        """Bytes allocated for K/V of all layers (window buffers, sinks, sliding layers)."""
        return sum(
            layer.nbytes() if isinstance(layer, SinkLayer) else layer.keys.nbytes + layer.values.nbytes
            for layer in self.layers if layer.is_initialized
        )


def leading_pad_counts(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[rows]` number of padding columns before each row's first real token of a 2-D mask `[rows, columns]`."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"`attention_mask` must be a 2-D tensor [rows, prompt_len], got {attention_mask!r}")
    return (attention_mask.long().cumsum(-1) == 0).sum(-1)


def _checked_layer_types(config: PreTrainedConfig) -> tuple[list[str], list[dict]]:
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("SinkCache supports decoder-only models; `config` is an encoder-decoder config")
    text_config = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    unsupported = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unsupported:
        raise ValueError(
            f"SinkCache supports full and sliding attention layers; this model's `config` has {unsupported}")
    if "full_attention" not in layer_types:
        raise ValueError(
            "SinkCache keeps sinks in full-attention layers, and every layer of this model's `config` is a sliding "
            f"window (sliding_window={getattr(text_config, 'sliding_window', None)}): its own cache already stays "
            "bounded; use the default cache"
        )
    return layer_types, layer_kwargs
