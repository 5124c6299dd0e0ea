"""PagedCache: a `transformers.Cache` whose layers keep K/V in a block pool, addressed through shared block tables.

Storage per layer: keys and values `[num_blocks, block_size, kv_heads, head_dim]`, allocated on the first update and
grown only if the pool grows. Bookkeeping (which block holds which row's tokens) lives once in `BlockTables` for all
layers; the first layer of each forward plans the step (`StepPlan`) and every layer executes it on its own tensors.
Attention gets dense `[rows, kv_heads, kv_length, head_dim]` K/V, as stock sdpa/eager expect: a zero-copy strided view
of the pool when rows own consecutive blocks at a uniform stride, else one block gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..display import CacheDisplay
from .block_pool import BlockPool
from .block_table import BlockCopies, BlockTables, StridedLayout
from .paged_config import PagedCacheConfig

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(slots=True)
class StepPlan:
    """Where one forward step writes and reads; the same for every layer."""

    write_slots: torch.Tensor  # [rows * q_len] flat slot ids (block * block_size + offset), row-major
    kv_length: int  # tokens every row attends over, new ones included
    num_blocks: int  # pool size the layers must have
    layout: StridedLayout | None  # set: read the pool as a strided view
    read_blocks: torch.Tensor | None  # [rows * blocks_read] block ids to gather when not strided
    copies: torch.Tensor | None  # [2, n] (source, destination) blocks to copy before writing


class PagedLayer(CacheLayerMixin):
    """One layer's K/V pool. Knows nothing of rows or blocks beyond the `StepPlan` it is handed."""

    is_croppable = True
    is_sliding = False  # sliding layers keep their whole history; the mask enforces the window

    def __init__(self, tables: BlockTables):
        super().__init__()
        self.tables = tables

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        block_size = self.tables.block_size
        # pools: [num_blocks, block_size, kv_heads, head_dim]
        self.keys = key_states.new_zeros((0, block_size, key_states.shape[1], key_states.shape[3]))
        self.values = value_states.new_zeros((0, block_size, value_states.shape[1], value_states.shape[3]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[rows, kv_heads, q_len, head_dim]` states, return `[rows, kv_heads, kv_length, head_dim]`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.shape[0] < plan.num_blocks:
            self.grow(plan.num_blocks)
        if plan.copies is not None:
            self.copy_blocks(plan.copies)
        _write(self.keys, key_states, plan.write_slots)
        _write(self.values, value_states, plan.write_slots)
        rows = key_states.shape[0]
        return _read(self.keys, plan, rows), _read(self.values, plan, rows)

    def grow(self, num_blocks: int) -> None:
        extra = num_blocks - self.keys.shape[0]
        self.keys = torch.cat([self.keys, self.keys.new_zeros((extra, *self.keys.shape[1:]))])
        self.values = torch.cat([self.values, self.values.new_zeros((extra, *self.values.shape[1:]))])

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """`copies`: [2, n] (source, destination) block ids."""
        if self.is_initialized:
            self.keys.index_copy_(0, copies[1], self.keys.index_select(0, copies[0]))
            self.values.index_copy_(0, copies[1], self.values.index_select(0, copies[0]))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tables.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tables.num_tokens

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes if self.is_initialized else 0


def _write(pool: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> None:
    # states: [rows, kv_heads, q_len, head_dim] -> [rows * q_len, kv_heads, head_dim] at flat slots
    flat = pool.view(-1, pool.shape[2], pool.shape[3])
    flat.index_copy_(0, slots, states.transpose(1, 2).reshape(-1, pool.shape[2], pool.shape[3]))


def _read(pool: torch.Tensor, plan: StepPlan, rows: int) -> torch.Tensor:
    _, block_size, heads, dim = pool.shape
    if plan.layout is not None:
        size = (rows, plan.kv_length, heads, dim)
        stride = (plan.layout.row_stride * block_size * heads * dim, heads * dim, dim, 1)
        dense = pool.as_strided(size, stride, pool.storage_offset() + plan.layout.first_block * block_size * heads * dim)
    else:
        gathered = pool.index_select(0, plan.read_blocks)
        dense = gathered.view(rows, -1, heads, dim)[:, : plan.kv_length]
    return dense.transpose(1, 2)


class PagedCache(CacheDisplay, Cache):
    """KV cache in fixed-size blocks with reference-counted sharing, for the ordinary `generate` loop.

    Rows with identical prompts (beams, `num_return_sequences`, repeated prompts) share the prompt's full blocks;
    beam reorders permute block tables and copy only a shared, partially filled last block when it is next written;
    `crop` frees whole blocks.

    Args:
        config: the model config (decoder-only, attention layers only).
        block_size: tokens per block.
        num_blocks: fixed pool size in blocks (exceeding it raises `OutOfBlocksError`, a `ValueError`).
        max_memory: fixed pool size in bytes (int or e.g. `"2GiB"`), for K and V of all layers.
        max_cache_len: tokens a row may reach; used to size the pool up front when neither limit is set.

    Example: `model.generate(**inputs, past_key_values=PagedCache(model.config, max_cache_len=512))`.
    """

    def __init__(self, config: PreTrainedConfig, block_size: int = 16, num_blocks: int | None = None,
                 max_memory: int | str | None = None, max_cache_len: int | None = None):
        self.settings = PagedCacheConfig(block_size=block_size, num_blocks=num_blocks, max_memory=max_memory)
        layer_types = _checked_layer_types(config)
        fixed = self.settings.num_blocks is not None or self.settings.max_memory is not None
        self.tables = BlockTables(BlockPool(self.settings.num_blocks or 0, growable=not fixed), block_size)
        self.max_cache_len = max_cache_len
        super().__init__(layers=[PagedLayer(self.tables) for _ in layer_types])
        self._plan: StepPlan | None = None
        self._shared_rows: list[tuple[int, int]] = []  # (row, group leader) pairs still to verify during prefill
        self._table_version = -1
        self._slot_table = torch.empty(0, dtype=torch.long)  # rebuilt when the tables change
        self._read_blocks: torch.Tensor | None = None
        self._layout: StridedLayout | None = None

    @property
    def pool(self) -> BlockPool:
        return self.tables.pool

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[rows, kv_heads, q_len, head_dim]` states of `layer_idx` and return its dense K/V."""
        if layer_idx == 0:
            self._plan = self._plan_step(key_states, value_states)
        elif self._shared_rows:
            self._verify_shared_rows(key_states, value_states, layer_idx)
        return self.layers[layer_idx].update(key_states, value_states, self._plan)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a non-positive count, as assisted decoding passes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        self.tables.crop(-tokens_to_remove)

    def keep_tokens(self, start: int, offsets: list[int]) -> None:
        """Keep tokens `start + offsets` (increasing) at `start, start + 1, ...`, crop the rest (tree speculation)."""
        self._build_plan(1, [], self.layers[0].keys.device)  # brings the slot table up to date
        table, size, count = self._slot_table, self.tables.block_size, len(offsets)
        moved = (torch.tensor([start + o for o in offsets]), torch.arange(start, start + count))
        source, target = ((table[:, p // size] + p % size).reshape(-1) for p in (m.to(table.device) for m in moved))
        for pool in (pool for layer in self.layers for pool in (layer.keys, layer.values)):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, target, pool.view(-1, *pool.shape[2:])[source])  # by slot
        self.tables.crop(self.tables.num_tokens - start - count)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.tables.reorder(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.tables.reorder([r for r in range(self.tables.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.tables.reorder(torch.as_tensor(indices).tolist())

    def reset(self) -> None:
        """Free every block; the pool stays allocated for the next request."""
        self.tables.release()
        self._plan, self._shared_rows = None, []

    def memory_bytes(self) -> int:
        """Bytes allocated for K/V pools of all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def used_bytes(self) -> int:
        """Bytes of the blocks that hold tokens (shared blocks counted once)."""
        num_blocks = max(self.pool.num_blocks, 1)
        return self.memory_bytes() * self.pool.num_used_blocks // num_blocks

    def summary(self) -> dict[str, object]:
        """`CacheDisplay`'s fields plus the pool's blocks in use (what `repr` and the Jupyter table show)."""
        return {**super().summary(), "blocks_used": f"{self.pool.num_used_blocks}/{self.pool.num_blocks}"}

    def _plan_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> StepPlan:
        rows, q_len = key_states.shape[0], key_states.shape[2]
        copies: BlockCopies = []
        if self.tables.num_rows == 0:
            self._prefill(key_states, value_states)
        elif rows != self.tables.num_rows:
            raise ValueError(f"PagedCache holds {self.tables.num_rows} rows but got a batch of {rows}")
        else:
            self._shared_rows = []
            copies = self.tables.append(q_len)
        return self._build_plan(q_len, copies, key_states.device)

    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, _, q_len, _ = key_states.shape
        group_of = _identical_rows(key_states, value_states) if q_len >= self.tables.block_size else list(range(rows))
        self._shared_rows = [(r, g) for r, g in enumerate(group_of) if g != r]
        self._size_pool(key_states, value_states, group_of)
        self.tables.prefill(q_len, group_of, reserve_tokens=self.max_cache_len or 0)

    def _size_pool(self, key_states: torch.Tensor, value_states: torch.Tensor, group_of: list[int]) -> None:
        if self.settings.max_memory is not None and self.pool.num_blocks == 0:
            per_block = self.tables.block_size * (key_states[0, :, 0].numel() + value_states[0, :, 0].numel())
            per_block *= key_states.element_size() * len(self.layers)
            if self.settings.max_memory < per_block:
                raise ValueError(f"`max_memory` ({self.settings.max_memory} bytes) is below one block ({per_block} bytes)")
            self.pool.grow(self.settings.max_memory // per_block)
        elif self.pool.growable:
            need = self.tables.prefill_need(key_states.shape[2], group_of, self.max_cache_len or 0)
            self.pool.grow(max(need - self.pool.num_free_blocks, 0))

    def _verify_shared_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        # Rows equal in layer 0 may still differ deeper (e.g. different attention masks): unshare those.
        differing = [
            r for r, g in self._shared_rows
            if not (torch.equal(key_states[r], key_states[g]) and torch.equal(value_states[r], value_states[g]))
        ]
        if not differing:
            return
        for r in differing:
            copies = _as_tensor(self.tables.unshare(r), key_states.device)
            for layer in self.layers[:layer_idx]:
                layer.copy_blocks(copies)
        self._shared_rows = [(r, g) for r, g in self._shared_rows if r not in differing]
        self._plan = self._build_plan(key_states.shape[2], [], key_states.device)

    def _build_plan(self, q_len: int, copies: BlockCopies, device: torch.device) -> StepPlan:
        tables, block_size = self.tables, self.tables.block_size
        if self._table_version != tables.version or self._slot_table.device != device:
            self._rebuild_slot_table(device)
        kv_length = tables.num_tokens
        if q_len == 1:  # decode: one column of the slot table
            slots = self._slot_table[:, (kv_length - 1) // block_size] + (kv_length - 1) % block_size
        else:
            positions = torch.arange(kv_length - q_len, kv_length, device=device)
            slots = (self._slot_table[:, positions // block_size] + positions % block_size).reshape(-1)
        return StepPlan(
            write_slots=slots,
            kv_length=kv_length,
            num_blocks=self.pool.num_blocks,
            layout=self._layout,
            read_blocks=self._read_blocks,
            copies=_as_tensor(copies, device) if copies else None,
        )

    def _rebuild_slot_table(self, device: torch.device) -> None:
        # slot table: [rows, max_blocks] first slot (block * block_size) of each row's blocks
        rows, block_size = self.tables.rows, self.tables.block_size
        width = max(len(row) for row in rows)
        padded = [[block * block_size for block in row] + [0] * (width - len(row)) for row in rows]
        self._slot_table = torch.tensor(padded, dtype=torch.long, device=device)
        self._layout, self._table_version = self.tables.strided_layout(), self.tables.version
        # every row holds exactly blocks_for(num_tokens) blocks, so a gather reads the whole table
        self._read_blocks = None if self._layout else self._slot_table.reshape(-1) // block_size


def _as_tensor(copies: BlockCopies, device: torch.device) -> torch.Tensor:
    return torch.tensor(copies, dtype=torch.long, device=device).reshape(-1, 2).T


def _identical_rows(key_states: torch.Tensor, value_states: torch.Tensor) -> list[int]:
    """`group_of[r]`: the first row whose layer K and V equal row r's exactly."""
    rows = key_states.shape[0]
    flat = torch.cat([key_states.reshape(rows, -1), value_states.reshape(rows, -1)], dim=1)
    _, inverse = torch.unique(flat, dim=0, return_inverse=True)
    first_of: dict[int, int] = {}
    return [first_of.setdefault(group, r) for r, group in enumerate(inverse.tolist())]


def _checked_layer_types(config: PreTrainedConfig) -> list[str]:
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("PagedCache supports decoder-only models; `config` is an encoder-decoder config")
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"PagedCache supports layer types {SUPPORTED_LAYER_TYPES}; this model's `config` has {unsupported}"
        )
    return layer_types
