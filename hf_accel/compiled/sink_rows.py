"""The sink cache under compiled generate: a window plus attention sinks over the static paged layout, with the
tokens `SinkCache` would attend and the positions it would give them (docs/caches.md, "SinkCache").

With N = `window_length` and S = `num_sink_tokens`, a decode step whose query sits at real position p reads:
- every cached token while p <= N;
- once p > N, the last N cached positions `p - N .. p - 1`, the first S of which show the row's own first S tokens
  (its sinks) moved there by RoPE (`delta = p - N`), the query keeping its own position.
The window is the attention's (`full_window = N + 1` for the layers with no window of their own; sliding layers of
hybrid models keep theirs, without sinks, as `SinkCache` keeps transformers' sliding layers). The sinks are
captured from the pool by `capture` (on the host, the first step a row's window is full: nothing has overwritten
them yet) and placed by `place`, traced into the compiled step before the forward: each full-attention layer's
sinks are written, keys re-rotated, over the slots of positions `p - N .. p - N + S - 1`, whose own tokens the
window no longer shows (rows not yet full write into the pool's spare block). The prefill
attends its whole prompt (a first step of `SinkCache` does). Rows live in a ring of blocks (`PagedRows`,
`ring_tokens`), so memory stays constant however long a row grows.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..cache.kv_shape import FULL_AND_SLIDING, KVShape
from ..cache.rope import rope_inverse_frequencies, rotate, rotation
from ..cache.sink_config import SinkCacheConfig
from ..runtime.kv_pool import KVPool, static_sizes
from .paged_rows import PagedRows, table_slots


@torch.library.custom_op("hf_accel_compiled::write_slots", mutates_args=("pool",))
def write_slots(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` `[kv_heads, n, head_dim]` at the flat `slots` `[n]` of `pool` `[kv_heads, blocks, block_size,
    head_dim]`, in place. An op that declares its mutation, so a compiled graph writes the pool where it lies (an
    `index_copy_` on a graph input is functionalized into a copy of the whole pool per write)."""
    pool.view(pool.shape[0], -1, pool.shape[-1]).index_copy_(1, slots, values)


@write_slots.register_fake
def _write_slots_fake(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    return None


class SinkRows:
    """The sinks of `rows` rows for one compiled `generate` call with `SinkCache` settings `settings`."""

    def __init__(self, model: PreTrainedModel, settings: SinkCacheConfig, rows: PagedRows):
        self.window, self.num_sinks = settings.window_length, settings.num_sink_tokens
        shape = KVShape.from_config(model.config, FULL_AND_SLIDING)
        self.layers = [layer for layer, window in enumerate(shape.sliding_windows) if window is None]
        self.inv_freq = rope_inverse_frequencies(model.config).to(rows.device)
        sinks = torch.arange(self.num_sinks, device=rows.device)
        self.sink_slots = table_slots(rows.block_table, sinks.expand(rows.rows, -1), rows.block_size)  # [rows, S]
        # where rows not yet full write their sinks: the pool's spare block, which nothing reads
        self.spare_slots = (rows.kv.spare_block * rows.block_size + sinks % rows.block_size).expand(rows.rows, -1)
        size = (shape.kv_heads, rows.rows, self.num_sinks, shape.head_dim)
        dtype = rows.kv.keys[0].dtype
        # per full-attention layer: [kv_heads, rows, S, head_dim] keys (at their own positions) and values
        self.keys = [static_sizes(torch.zeros(size, dtype=dtype, device=rows.device)) for _ in self.layers]
        self.values = [static_sizes(torch.zeros(size, dtype=dtype, device=rows.device)) for _ in self.layers]
        self.captured = torch.zeros(rows.rows, dtype=torch.bool, device=rows.device)

    @property
    def full_window(self) -> int:
        """The attention window of full-attention layers at decode steps: N cached positions and the query."""
        return self.window + 1

    def capture(self, kv: KVPool, positions: torch.Tensor) -> None:
        """Outside the graph, before a decode step with queries at `positions` `[rows]`: copy the sinks of the rows
        whose window is full for the first time out of the pool (nothing has overwritten them yet)."""
        due = (positions > self.window) & ~self.captured
        if self.num_sinks == 0 or not bool(due.any()):
            return
        rows = due.nonzero()[:, 0]
        slots = self.sink_slots[rows].reshape(-1)
        for index, layer in enumerate(self.layers):
            for pools, saved in ((kv.keys, self.keys), (kv.values, self.values)):
                flat = pools[layer].view(pools[layer].shape[0], -1, pools[layer].shape[-1])  # [kv_heads, slots, dim]
                saved[index][:, rows] = flat.index_select(1, slots).view(flat.shape[0], len(rows), -1, flat.shape[-1])
        self.captured |= due

    def place(self, kv: KVPool, block_table: torch.Tensor, positions: torch.Tensor) -> None:
        """Inside the graph, before a decode step with queries at `positions` `[rows]`: write each full row's
        sinks, keys moved by RoPE, over the first S slots of its window (the other rows write to the spare block)."""
        if self.num_sinks == 0:
            return
        full = positions > self.window  # [rows]
        targets = (positions - self.window).clamp_min(0)[:, None] + torch.arange(self.num_sinks,
                                                                                  device=positions.device)
        slots = torch.where(full[:, None], table_slots(block_table, targets, kv.block_size), self.spare_slots)
        slots = slots.reshape(-1)  # [rows * S]
        cos, sin = rotation(positions - self.window, self.inv_freq)  # [rows, rotary_dim]
        for index, layer in enumerate(self.layers):
            heads, rows, num, dim = self.keys[index].shape
            moved = rotate(self.keys[index].transpose(0, 1), cos, sin).transpose(0, 1)  # rotate: [rows, heads, ...]
            for pool, sinks in ((kv.keys[layer], moved), (kv.values[layer], self.values[index])):
                write_slots(pool, slots, sinks.reshape(heads, rows * num, dim))
