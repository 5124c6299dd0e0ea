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

Storage per full-attention layer: `key_buffer` / `value_buffer` `[rows, kv_heads, capacity, head_dim]` of consecutive
columns (capacity `window_length + slack`, allocated once; `update` returns a view of it) and the sinks as they arrived
`[rows, kv_heads, S, head_dim]`. `keys` / `values` show, as in every transformers layer, `[rows, kv_heads, kept,
head_dim]`: the tokens the next step will read, built when read. Eviction is lazy (at the start of the next step), so
`crop` can take back the last step, as assisted decoding does. Sliding-window layers (of hybrid models, or every layer
of a Mistral-style model) keep transformers' own sliding layer.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..display import CacheDisplay
from .kv_shape import FULL_AND_SLIDING, KVShape
from .rope import rope_inverse_frequencies, rotate
from .row_layer import RowLayer, RowSelect
from .sink_config import SinkCacheConfig
from .sink_window import SinkStep, SinkWindow


class SinkLayer(RowLayer):
    """One full-attention layer's window buffer and sinks; executes the `SinkStep` its cache plans."""

    is_croppable = True
    is_sliding = False

    def __init__(self, window: SinkWindow):
        # not CacheLayerMixin.__init__: it assigns `keys` / `values`, which are read-only views here
        self.is_initialized = False
        self.window = window
        self.key_buffer: torch.Tensor | None = None  # [rows, kv_heads, capacity, head_dim]: consecutive columns
        self.value_buffer: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None  # [rows, kv_heads, S, head_dim]: sinks at their own positions
        self.sink_values: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        """`[rows, kv_heads, kept, head_dim]`: the tokens kept for the next step, as it will read them (sinks first,
        moved next to the recent tokens, once the window is full); computed on access."""
        return self._kept()[0] if self.is_initialized else None

    @property
    def values(self) -> torch.Tensor | None:
        """`[rows, kv_heads, kept, head_dim]`: the values of `keys`' tokens; computed on access."""
        return self._kept()[1] if self.is_initialized else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, dim = key_states.shape
        self.key_buffer = key_states.new_zeros((rows, heads, 0, dim))
        self.value_buffer = value_states.new_zeros((rows, heads, 0, value_states.shape[3]))
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
        if self.key_buffer.shape[2] < step.capacity:
            self.grow(step.capacity)
        if step.capture_index is not None:
            self.capture_sinks(key_states, value_states, step)
        if step.compact is not None:
            source, length = step.compact
            self.key_buffer[:, :, :length] = self.key_buffer[:, :, source : source + length].clone()
            self.value_buffer[:, :, :length] = self.value_buffer[:, :, source : source + length].clone()
        if step.show_sinks:
            self.show_sinks(step)
        if step.overflow:
            return self.concatenate(key_states, value_states, step)
        end = step.write_slot + step.num_new
        self.key_buffer[:, :, step.write_slot : end] = key_states
        self.value_buffer[:, :, step.write_slot : end] = value_states
        return self.key_buffer[:, :, step.read_slot : end], self.value_buffer[:, :, step.read_slot : end]

    def grow(self, capacity: int) -> None:
        extra = capacity - self.key_buffer.shape[2]
        self.key_buffer = _grown(self.key_buffer, extra)
        self.value_buffer = _grown(self.value_buffer, extra)

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
        keys, values = self.shown_sinks(step, self.key_buffer[:, :, region], self.value_buffer[:, :, region])
        self.key_buffer[:, :, region] = keys
        self.value_buffer[:, :, region] = values

    def shown_sinks(
        self, step: SinkStep, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first S slots a step returns, `[rows, kv_heads, S, head_dim]`: the rows in `step.sink_rows` show their
        sinks moved by their `delta`, the others keep `keys` / `values` (the true columns there)."""
        sink_keys = rotate(self.sink_keys, step.cos.to(self.sink_keys.device), step.sin.to(self.sink_keys.device))
        if step.sink_rows is None:
            return sink_keys, self.sink_values
        rows = step.sink_rows[:, None, None, None]
        return torch.where(rows, sink_keys, keys), torch.where(rows, self.sink_values, values)

    def _kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.window.kept(self.key_buffer.shape[0], self.key_buffer.device)
        keys = self.key_buffer[:, :, step.read_slot : step.write_slot]
        values = self.value_buffer[:, :, step.read_slot : step.write_slot]
        if not step.show_sinks:
            return keys, values
        num_sinks = self.sink_keys.shape[2]
        sink_keys, sink_values = self.shown_sinks(step, keys[:, :, :num_sinks], values[:, :, :num_sinks])
        return (torch.cat([sink_keys, keys[:, :, num_sinks:]], dim=2),
                torch.cat([sink_values, values[:, :, num_sinks:]], dim=2))

    def concatenate(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: SinkStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step longer than the buffer (e.g. a long prompt): return all its K/V, keep the last `step.keep`."""
        cached = slice(step.read_slot, step.write_slot)
        keys, values = key_states, value_states
        if step.write_slot > step.read_slot:
            keys = torch.cat([self.key_buffer[:, :, cached], key_states], dim=2)
            values = torch.cat([self.value_buffer[:, :, cached], value_states], dim=2)
        self.key_buffer[:, :, : step.keep] = keys[:, :, -step.keep :]
        self.value_buffer[:, :, : step.keep] = values[:, :, -step.keep :]
        return keys, values

    def _select_rows(self, select: RowSelect) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = select(self.key_buffer), select(self.value_buffer)
            self.sink_keys, self.sink_values = select(self.sink_keys), select(self.sink_values)

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = self.sink_keys = self.sink_values = None
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
        return sum(t.nbytes for t in (self.key_buffer, self.value_buffer, self.sink_keys, self.sink_values))


class SinkCache(CacheDisplay, Cache):
    """Sliding window of `window_length` tokens per row, the first `num_sink_tokens` of them the row's first real
    tokens (attention sinks), at constant memory: generation can run past `max_position_embeddings`.

    Args:
        config: the model config: decoder-only, with RoPE of fixed frequencies where it has full-attention layers
            (sliding-window layers keep the model's own window: on a model whose every layer slides, the cache is
            transformers' sliding layers, bounded by the model's window).
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
        shape = KVShape.from_config(config, FULL_AND_SLIDING, "SinkCache")
        layer_types, layer_kwargs = shape.layer_types, shape.layer_kwargs
        pad_counts = None if attention_mask is None else leading_pad_counts(attention_mask)
        has_full = "full_attention" in layer_types
        inv_freq = rope_inverse_frequencies(config, "full_attention") if has_full else torch.empty(0)
        self.window = SinkWindow(self.settings, inv_freq, pad_counts, max_cache_len)
        super().__init__(layers=[
            SinkLayer(self.window) if kind == "full_attention" else DynamicSlidingWindowLayer(**kwargs)
            for kind, kwargs in zip(layer_types, layer_kwargs)
        ])
        self.first_sink_layer = layer_types.index("full_attention") if has_full else None
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
        if self.first_sink_layer is not None:
            self.window.crop(-tokens_to_remove)  # sink layers keep their tensors: only the column count moves back
        for layer in self.layers:
            if not isinstance(layer, SinkLayer):
                layer.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.window.select_rows(beam_idx)
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.window.repeat_rows(repeats)
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.window.select_rows(torch.as_tensor(indices))
        for layer in self.layers:
            layer.batch_select_indices(indices)

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


def _grown(buffer: torch.Tensor, extra: int) -> torch.Tensor:
    """`buffer` `[rows, kv_heads, capacity, head_dim]` with `extra` zero slots appended."""
    rows, heads, _, dim = buffer.shape
    return torch.cat([buffer, buffer.new_zeros((rows, heads, extra, dim))], dim=2)


def leading_pad_counts(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[rows]` number of padding columns before each row's first real token of a 2-D mask `[rows, columns]`."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"`attention_mask` must be a 2-D tensor [rows, prompt_len], got {attention_mask!r}")
    return (attention_mask.long().cumsum(-1) == 0).sum(-1)

