"""PagedGroup: the paged layers that keep the same tokens (every full-attention layer, or every sliding layer of one
window) and the one `BlockTables` they share. The group's first layer plans each forward step (`StepPlan`); every
layer of the group executes that plan on its own pools.

Sliding groups mirror `DynamicSlidingWindowLayer`: a step after `n` tokens attends to tokens from
`max(n - sliding_window + 1, 0)`, and blocks wholly before that are freed when the step starts (lazily, so `crop` can
take back the last step). A multi-token step that would push its own first tokens out of the window (a long prompt)
is not stored whole: the layers return the cached window plus the step's states and store only the last
`sliding_window - 1` tokens, as transformers does. After `activate_past_recording` (assisted decoding, for the main
model and its assistant) every token is kept until the next `crop`, which then evicts what left the window.
"""

from __future__ import annotations

import torch

from .block_pool import BlockPool
from .block_table import BlockCopies, BlockTables, StridedLayout
from .paged_config import PagedCacheConfig
from .paged_layer import PagedLayer, PoolRead, StepPlan


class PagedGroup:
    """Block tables and step planning for `layers` (all full attention, or all sliding with `sliding_window`).

    Args:
        pool: the block ids this group's tables allocate from (each layer's pools are indexed by them).
        settings: the cache's settings (block size, fixed pool size).
        sliding_window: the layers' window, or None for layers that keep every token.
        max_cache_len: tokens a row may reach, to size the pool up front (None: unknown).
        num_cache_layers: layers of the whole cache, to turn `max_memory` into blocks.
    """

    def __init__(self, pool: BlockPool, settings: PagedCacheConfig, sliding_window: int | None,
                 max_cache_len: int | None, num_cache_layers: int):
        self.tables = BlockTables(pool, settings.block_size)
        self.settings, self.sliding_window, self.max_cache_len = settings, sliding_window, max_cache_len
        self.num_cache_layers = num_cache_layers
        self.layers: list[PagedLayer] = []
        self.first_layer = -1  # cache index of the layer that plans each step
        self.is_recording_past = False
        self.plan: StepPlan | None = None
        self.shared_rows: list[tuple[int, int]] = []  # (row, group leader) pairs still to verify during prefill
        self._table_version = -1
        self._slot_table = torch.empty(0, dtype=torch.long)  # rebuilt when the tables change
        self._read_blocks: torch.Tensor | None = None
        self._layout: StridedLayout | None = None

    def first_visible(self, num_tokens: int) -> int:
        """The first token a step after `num_tokens` tokens attends to."""
        return 0 if self.sliding_window is None else max(num_tokens - self.sliding_window + 1, 0)

    @torch.compiler.disable  # host-side bookkeeping (plain Python lists): a compiled forward calls it untraced
    def plan_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> StepPlan:
        """Lay out a step of `[rows, kv_heads, q_len, head_dim]` states (the group's first layer's) in the tables."""
        rows, q_len = key_states.shape[0], key_states.shape[2]
        tables, device = self.tables, key_states.device
        if tables.num_rows not in (0, rows):
            raise ValueError(f"PagedCache holds {tables.num_rows} rows but got a batch of {rows}")
        start = tables.num_tokens
        read_from = self.first_visible(start)
        keep_from = read_from
        if self.sliding_window is not None and q_len > 1 and not self.is_recording_past:
            keep_from = max(read_from, self.first_visible(start + q_len))
        cached = None
        if keep_from > read_from and start > read_from:  # a long sliding step: read the window before evicting
            cached = self._pool_read(read_from, start - read_from, device)
        self.shared_rows = []
        copies: BlockCopies = []
        if tables.num_rows == 0 or keep_from > start:  # nothing held that the step keeps: lay the rows out anew
            tables.release()
            self._prefill(key_states, value_states, start + q_len, keep_from)
        else:
            if not self.is_recording_past:
                tables.evict_before(keep_from)
            copies = tables.append(q_len)
        return self._build_plan(q_len, keep_from, cached, copies, device)

    def verify_shared_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, layer: PagedLayer) -> None:
        """Rows equal in the group's first layer may still differ in `layer` (e.g. different attention masks):
        give those private blocks, copied in the layers before `layer`."""
        differing = [
            r for r, g in self.shared_rows
            if not (torch.equal(key_states[r], key_states[g]) and torch.equal(value_states[r], value_states[g]))
        ]
        if not differing:
            return
        for r in differing:
            copies = _as_tensor(self.tables.unshare(r), key_states.device)
            for earlier in self.layers[: self.layers.index(layer)]:
                earlier.copy_blocks(copies)
        self.shared_rows = [(r, g) for r, g in self.shared_rows if r not in differing]
        plan = self.plan
        self.plan = self._build_plan(key_states.shape[2], self.tables.first_token, plan.read if plan.append_new
                                     else None, [], key_states.device)

    def crop(self, num_remove: int) -> None:
        """Forget the last `num_remove` tokens of every row; raises `ValueError` if a sliding window would need
        evicted tokens back."""
        tables = self.tables
        remaining = max(tables.num_tokens - num_remove, 0)
        if num_remove and self.first_visible(remaining) < tables.first_token:
            raise ValueError(
                f"Cannot crop {num_remove} tokens from the paged cache's sliding layers (window "
                f"{self.sliding_window}): tokens before {tables.first_token} are evicted; call "
                "`activate_past_recording()` first (assisted decoding does) to keep every token until the next crop")
        tables.crop(num_remove)
        if self.is_recording_past:
            tables.evict_before(self.first_visible(remaining))

    def slots_of(self, positions: list[int], device: torch.device) -> torch.Tensor:
        """`[rows, n]` flat slot ids of tokens `positions` in every row."""
        if min(positions) < self.tables.first_token:
            raise ValueError(f"tokens before {self.tables.first_token} are evicted from the sliding layers")
        return self._slots(torch.tensor(positions, device=device))

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        self._refresh(positions.device)
        size = self.tables.block_size
        return self._slot_table[:, positions // size - self.tables.first_block] + positions % size

    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor, total: int, first_token: int) -> None:
        rows, _, q_len, _ = key_states.shape
        group_of = list(range(rows))
        if rows > 1 and q_len >= self.tables.block_size and total == q_len:  # a fresh prompt: identical rows share
            group_of = _identical_rows(key_states, value_states)
        self.shared_rows = [(r, g) for r, g in enumerate(group_of) if g != r]
        reserve = self._reserve_tokens(first_token)
        self.tables.first_token = first_token
        self._size_pool(key_states, value_states, total, group_of, reserve)
        self.tables.prefill(total, group_of, reserve_tokens=reserve, first_token=first_token)

    def _reserve_tokens(self, first_token: int) -> int:
        if self.sliding_window is None:
            return self.max_cache_len or 0
        # a row holds at most the window plus one step, in one more block than it fills
        steady = (first_token // self.tables.block_size + self.tables.blocks_for(self.sliding_window) + 1)
        return min(steady * self.tables.block_size, self.max_cache_len or steady * self.tables.block_size)

    def _size_pool(self, key_states: torch.Tensor, value_states: torch.Tensor, total: int, group_of: list[int],
                   reserve: int) -> None:
        pool = self.tables.pool
        if self.settings.max_memory is not None and pool.num_blocks == 0:
            per_block = self.tables.block_size * (key_states[0, :, 0].numel() + value_states[0, :, 0].numel())
            per_block *= key_states.element_size() * self.num_cache_layers
            if self.settings.max_memory < per_block:
                raise ValueError(
                    f"`max_memory` ({self.settings.max_memory} bytes) is below one block ({per_block} bytes)")
            pool.grow(self.settings.max_memory // per_block)
        elif pool.growable:
            need = self.tables.prefill_need(total, group_of, reserve)
            pool.grow(max(need - pool.num_free_blocks, 0))

    def _build_plan(self, q_len: int, keep_from: int, cached: PoolRead | None, copies: BlockCopies,
                    device: torch.device) -> StepPlan:
        end = self.tables.num_tokens
        written_from = max(keep_from, end - q_len)
        read_from = self.first_visible(end - q_len)
        append_new = keep_from > read_from  # tokens read by this step are evicted by it: return them from `cached`
        written = self._pool_read(written_from, end - written_from, device)
        strided = written.layout is not None  # then the layers write through a view; no slot ids needed
        return StepPlan(
            write_slots=None if strided else self._write_slots(written_from, end, device),
            write_at=written if strided else None,
            num_written=end - written_from,
            kv_length=end - read_from,
            num_blocks=self.tables.pool.num_blocks,
            read=cached if append_new else self._pool_read(read_from, end - read_from, device),
            append_new=append_new,
            copies=_as_tensor(copies, device) if copies else None,
        )

    def _write_slots(self, first: int, end: int, device: torch.device) -> torch.Tensor:
        """`[rows * (end - first)]` flat slot ids of tokens `first .. end - 1` of every row, row-major."""
        if end - first == 1:  # decode: one column of the slot table
            block, offset = divmod(first, self.tables.block_size)
            return self._slot_table[:, block - self.tables.first_block] + offset
        return self._slots(torch.arange(first, end, device=device)).reshape(-1)

    def _pool_read(self, first: int, length: int, device: torch.device) -> PoolRead:
        self._refresh(device)
        start = first - self.tables.first_block * self.tables.block_size
        return PoolRead(self._layout, self._read_blocks, start, length)

    def _refresh(self, device: torch.device) -> None:
        # slot table: [rows, held blocks] first slot (block * block_size) of each row's blocks
        tables = self.tables
        if self._table_version == tables.version and self._slot_table.device == device:
            return
        width = max((len(row) for row in tables.rows), default=0)
        padded = [[block * tables.block_size for block in row] + [0] * (width - len(row)) for row in tables.rows]
        self._slot_table = torch.tensor(padded, dtype=torch.long, device=device).reshape(tables.num_rows, width)
        self._layout, self._table_version = tables.strided_layout(), tables.version
        # every row holds the same number of blocks, so a gather reads the whole table
        self._read_blocks = None if self._layout else self._slot_table.reshape(-1) // tables.block_size


def _as_tensor(copies: BlockCopies, device: torch.device) -> torch.Tensor:
    return torch.tensor(copies, dtype=torch.long, device=device).reshape(-1, 2).T


def _identical_rows(key_states: torch.Tensor, value_states: torch.Tensor) -> list[int]:
    """`group_of[r]`: the first row whose layer K and V equal row r's exactly."""
    rows = key_states.shape[0]
    flat = torch.cat([key_states.reshape(rows, -1), value_states.reshape(rows, -1)], dim=1)
    _, inverse = torch.unique(flat, dim=0, return_inverse=True)
    first_of: dict[int, int] = {}
    return [first_of.setdefault(group, r) for r, group in enumerate(inverse.tolist())]
