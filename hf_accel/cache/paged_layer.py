"""Paged KV layers: one layer's key and value pools, written and read as the step's `StepPlan` says.

Pools: `key_pool` / `value_pool` `[num_blocks, block_size, kv_heads, head_dim]`, allocated on the first update and
grown only when the pool of block ids grows. A layer knows nothing of rows or blocks beyond the plan it is handed and
the `BlockTables` of its group (read only to show `keys` / `values`). Attention gets dense
`[rows, kv_heads, kv_length, head_dim]` K/V: a zero-copy strided view of the pool when rows own consecutive blocks at a
uniform stride, else one block gather. `keys` / `values` are, as in every transformers layer,
`[rows, kv_heads, seq_len, head_dim]` of the stored tokens (a sliding layer: the last `sliding_window - 1`, as
`DynamicSlidingWindowLayer` keeps), gathered when read and never in `update`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from .block_table import BlockTables, StridedLayout


@dataclass(slots=True)
class PoolRead:
    """Where every row's tokens to read lie: `length` tokens from token `start` of the row's first held block."""

    layout: StridedLayout | None  # set: a strided view of the pool
    blocks: torch.Tensor | None  # else: [rows * blocks_per_row] block ids to gather, row-major
    start: int
    length: int


@dataclass(slots=True)
class StepPlan:
    """Where one forward step writes and reads; the same for every layer of a group."""

    write_at: PoolRead | None  # where the new tokens go, as a strided view, when the rows' blocks allow one
    write_slots: torch.Tensor | None  # else: [rows * num_written] flat slot ids (block * block_size + offset)
    num_written: int  # the last `num_written` new tokens of each row are stored (all but in a long sliding step)
    kv_length: int  # tokens every row attends over, new ones included
    num_blocks: int  # pool size the layers must have
    read: PoolRead | None  # the returned tokens; with `append_new`, only the cached ones (None: no cached ones)
    append_new: bool  # return the cached tokens read, then the new states (a sliding layer's long step)
    copies: torch.Tensor | None  # [2, n] (source, destination) blocks to copy before writing


class PagedLayer(CacheLayerMixin):
    """One layer's K/V pools; every token from the first one is kept (full or chunked attention)."""

    is_croppable = True
    is_sliding = False

    def __init__(self, tables: BlockTables):
        # not CacheLayerMixin.__init__: it assigns `keys` / `values`, which are read-only views here
        self.is_initialized = False
        self.tables = tables
        self.key_pool: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.value_pool: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        """`[rows, kv_heads, seq_len, head_dim]`: the stored keys, gathered from the pool when read."""
        return self._stored(self.key_pool)

    @property
    def values(self) -> torch.Tensor | None:
        """`[rows, kv_heads, seq_len, head_dim]`: the stored values, gathered from the pool when read."""
        return self._stored(self.value_pool)

    def first_visible(self, num_tokens: int) -> int:
        """The first token a step after `num_tokens` tokens attends to."""
        return 0

    def first_shown(self) -> int:
        """The first token `keys` / `values` show."""
        return 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        block_size = self.tables.block_size
        self.key_pool = key_states.new_zeros((0, block_size, key_states.shape[1], key_states.shape[3]))
        self.value_pool = value_states.new_zeros((0, block_size, value_states.shape[1], value_states.shape[3]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[rows, kv_heads, q_len, head_dim]` states, return `[rows, kv_heads, kv_length, head_dim]`."""
        self.prepare(key_states, value_states, plan)
        _write(self.key_pool, key_states, plan)
        _write(self.value_pool, value_states, plan)
        rows = key_states.shape[0]
        return read_pool(self.key_pool, plan.read, rows), read_pool(self.value_pool, plan.read, rows)

    def prepare(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan) -> None:
        """Allocate or grow the pools to the plan's size and perform its block copies."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.key_pool.shape[0] < plan.num_blocks:
            self.grow(plan.num_blocks)
        if plan.copies is not None:
            self.copy_blocks(plan.copies)

    def grow(self, num_blocks: int) -> None:
        self.key_pool, self.value_pool = _grown(self.key_pool, num_blocks), _grown(self.value_pool, num_blocks)

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """`copies`: [2, n] (source, destination) block ids."""
        if self.is_initialized:
            self.key_pool.index_copy_(0, copies[1], self.key_pool.index_select(0, copies[0]))
            self.value_pool.index_copy_(0, copies[1], self.value_pool.index_select(0, copies[0]))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tables.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tables.num_tokens

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return self.key_pool.nbytes + self.value_pool.nbytes if self.is_initialized else 0

    def _stored(self, pool: torch.Tensor | None) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        tables = self.tables
        if tables.num_rows == 0:
            return pool.new_zeros((0, pool.shape[2], 0, pool.shape[3]))
        first = self.first_shown()
        blocks = torch.tensor(tables.rows, dtype=torch.long, device=pool.device).reshape(-1)
        read = PoolRead(None, blocks, first - tables.first_block * tables.block_size, tables.num_tokens - first)
        return read_pool(pool, read, tables.num_rows)


class PagedSlidingLayer(PagedLayer):
    """A sliding-window layer's pools: keeps, reads and reports the tokens `DynamicSlidingWindowLayer` would (its
    `get_mask_sizes`); the group evicts whole blocks that fall out of the window."""

    is_sliding = True

    def __init__(self, tables: BlockTables, sliding_window: int):
        super().__init__(tables)
        self.sliding_window = sliding_window
        self.record_past = False

    def activate_past_recording(self) -> None:
        """Show every token kept until the next `crop` (the group keeps them), as `DynamicSlidingWindowLayer` does."""
        self.record_past = True

    def first_visible(self, num_tokens: int) -> int:
        return max(num_tokens - self.sliding_window + 1, 0)

    def first_shown(self) -> int:
        # transformers' sliding layer keeps the last `sliding_window - 1` tokens, or all since the last crop
        return self.tables.first_token if self.record_past else self.first_visible(self.tables.num_tokens)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `PagedLayer.update`; a long step returns the cached window then its own states and stores only the
        tokens the window keeps."""
        if not plan.append_new:
            return super().update(key_states, value_states, plan)
        rows = key_states.shape[0]
        keys, values = key_states, value_states
        if plan.read is not None:  # read before copying or writing: both may reuse the evicted blocks
            keys = torch.cat([read_pool(self.key_pool, plan.read, rows), key_states], dim=2)
            values = torch.cat([read_pool(self.value_pool, plan.read, rows), value_states], dim=2)
        self.prepare(key_states, value_states, plan)
        _write(self.key_pool, key_states, plan)
        _write(self.value_pool, value_states, plan)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        num_tokens = self.tables.num_tokens
        kv_offset = self.first_visible(num_tokens)
        return num_tokens - kv_offset + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window


def _grown(pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`pool` with zeroed blocks appended up to `num_blocks` (zeros: unwritten slots are masked, never NaN)."""
    grown = pool.new_zeros((num_blocks, *pool.shape[1:]))
    grown[: pool.shape[0]] = pool
    return grown


def _write(pool: torch.Tensor, states: torch.Tensor, plan: StepPlan) -> None:
    # states: [rows, kv_heads, q_len, head_dim] -> last num_written: [rows * num_written, kv_heads, head_dim] at slots
    if plan.num_written < states.shape[2]:
        states = states[:, :, states.shape[2] - plan.num_written :]
    if plan.write_at is not None:  # a strided copy is a memcpy per row; index_copy_ goes element by element
        _strided(pool, plan.write_at, states.shape[0]).copy_(states.transpose(1, 2))
        return
    flat = pool.view(-1, pool.shape[2], pool.shape[3])
    flat.index_copy_(0, plan.write_slots, states.transpose(1, 2).reshape(-1, pool.shape[2], pool.shape[3]))


def read_pool(pool: torch.Tensor, read: PoolRead, rows: int) -> torch.Tensor:
    """`[rows, kv_heads, read.length, head_dim]` from a pool `[num_blocks, block_size, kv_heads, head_dim]`."""
    if read.layout is not None:
        return _strided(pool, read, rows).transpose(1, 2)
    _, _, heads, dim = pool.shape
    gathered = pool.index_select(0, read.blocks)
    return gathered.view(rows, -1, heads, dim)[:, read.start : read.start + read.length].transpose(1, 2)


def _strided(pool: torch.Tensor, where: PoolRead, rows: int) -> torch.Tensor:
    """`[rows, where.length, kv_heads, head_dim]` view of the pool at a strided `where` (no copy)."""
    _, block_size, heads, dim = pool.shape
    size = (rows, where.length, heads, dim)
    stride = (where.layout.row_stride * block_size * heads * dim, heads * dim, dim, 1)
    first_token = where.layout.first_block * block_size + where.start
    return pool.as_strided(size, stride, pool.storage_offset() + first_token * heads * dim)
