"""PagedCache: a `transformers.Cache` whose layers keep K/V in block pools, addressed through shared block tables.

Layers that keep the same tokens form a `PagedGroup` (every full-attention layer; every sliding layer of one window)
with one `BlockTables` over its own `BlockPool`; each layer owns pools `[num_blocks, block_size, kv_heads, head_dim]`
indexed by its group's block ids (`paged_layer.py`). The group's first layer plans each step (`StepPlan`) and every
layer of the group executes it. Sliding groups free the blocks that fall out of the window, so Mistral- and
Gemma-style sliding layers stop growing. Layers show `keys` / `values` `[rows, kv_heads, seq_len, head_dim]` as
transformers' layers do, gathered from the pools when read.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from ..display import CacheDisplay
from ..prefill_hooks import PrefillHooks
from .block_pool import BlockPool
from .block_table import BlockTables
from .kv_shape import ATTENTION_KINDS, KVShape
from .paged_config import PagedCacheConfig
from .paged_group import PagedGroup
from .paged_layer import PagedLayer, PagedSlidingLayer
from .prefix_store import PrefixStore

class PagedCache(CacheDisplay, PrefillHooks, Cache):
    """KV cache in fixed-size blocks with reference-counted sharing, for the ordinary `generate` loop.

    Rows with identical prompts (beams, `num_return_sequences`, repeated prompts) share the prompt's full blocks;
    beam reorders permute block tables and copy only a shared, partially filled last block when it is next written;
    `crop` frees whole blocks; sliding-window layers free the blocks that leave their window.

    Args:
        config: the model config (decoder-only, attention layers only).
        block_size: tokens per block.
        num_blocks: fixed pool size in blocks, per layer (exceeding it raises `OutOfBlocksError`, a `ValueError`).
        max_memory: fixed pool size in bytes (int or e.g. `"2GiB"`), for K and V of all layers.
        max_cache_len: tokens a row may reach; used to size the pool up front when neither limit is set.
        prefix_store: a `PrefixStore` of this model: the prompt columns it holds are loaded instead of computed, and
            the prompt's full blocks are added to it after the prefill (`prefix_store.py`).

    Example: `model.generate(**inputs, past_key_values=PagedCache(model.config, max_cache_len=512))`.
    """

    def __init__(self, config: PreTrainedConfig, block_size: int = 16, num_blocks: int | None = None,
                 max_memory: int | str | None = None, max_cache_len: int | None = None,
                 prefix_store: PrefixStore | None = None):
        self.settings = PagedCacheConfig(block_size=block_size, num_blocks=num_blocks, max_memory=max_memory)
        if prefix_store is not None and not isinstance(prefix_store, PrefixStore):
            raise TypeError(f"`prefix_store` must be a hf_accel.PrefixStore or None, got {type(prefix_store).__name__}")
        if prefix_store is not None:
            prefix_store.check_cache(config, block_size)
        self.prefix_store = prefix_store
        self._saved_recording: list[bool] | None = None  # set between before_prefill and after_prefill with a store
        self._prefix_chains: list[list[bytes]] | None = None  # the prompt rows' block keys, from load to save
        self.max_cache_len = max_cache_len
        windows = KVShape.from_config(config, ATTENTION_KINDS, "PagedCache").sliding_windows
        fixed = self.settings.num_blocks is not None or self.settings.max_memory is not None
        groups: dict[int | None, PagedGroup] = {}
        layers, self.group_of_layer = [], []
        for index, window in enumerate(windows):
            if window not in groups:
                pool = BlockPool(self.settings.num_blocks or 0, growable=not fixed)
                groups[window] = PagedGroup(pool, self.settings, window, max_cache_len, len(windows))
                groups[window].first_layer = index
            group = groups[window]
            layer = PagedLayer(group.tables) if window is None else PagedSlidingLayer(group.tables, window)
            group.layers.append(layer)
            layers.append(layer)
            self.group_of_layer.append(group)
        self.groups = list(groups.values())
        super().__init__(layers=layers)

    @property
    def tables(self) -> BlockTables:
        """Block tables of the full-attention layers (of the sliding layers when every layer slides)."""
        full = [group for group in self.groups if group.sliding_window is None]
        return (full or self.groups)[0].tables

    @property
    def pool(self) -> BlockPool:
        """Block ids of `tables`."""
        return self.tables.pool

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[rows, kv_heads, q_len, head_dim]` states of `layer_idx` and return its dense K/V."""
        group = self.group_of_layer[layer_idx]
        layer = self.layers[layer_idx]
        if layer_idx == group.first_layer:
            group.plan = group.plan_step(key_states, value_states)
        elif group.shared_rows:
            group.verify_shared_rows(key_states, value_states, layer)
        return layer.update(key_states, value_states, group.plan)

    def before_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """With a prefix store and no tokens yet: load the stored prompt columns, and keep every prompt token in the
        sliding layers until `after_prefill` has stored them."""
        if self.prefix_store is None or self.get_seq_length() != 0:
            return
        self._saved_recording = [group.is_recording_past for group in self.groups]
        for group in self.groups:
            group.is_recording_past = True
        self._prefix_chains = self.prefix_store.load(input_ids, attention_mask, self.fill_columns)

    def after_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Add the prompt's full blocks to the prefix store; sliding layers evict as usual from the next step."""
        if self._saved_recording is None:
            return
        try:
            self.prefix_store.save(input_ids, attention_mask, self.gather_blocks, self._prefix_chains)
        finally:
            for group, recording in zip(self.groups, self._saved_recording):
                group.is_recording_past = recording
            self._saved_recording = self._prefix_chains = None

    def fill_columns(self, columns: torch.Tensor) -> None:
        """Write `columns` `[num_layers, 2 (K, V), rows, n, kv_heads, head_dim]` as the first `n` tokens of every
        row of this empty cache."""
        with torch.no_grad():
            for layer in range(len(self.layers)):
                self.update(columns[layer, 0].transpose(1, 2), columns[layer, 1].transpose(1, 2), layer)

    def gather_blocks(self, starts: list[tuple[int, int]]) -> torch.Tensor:
        """`[num_layers, 2 (K, V), len(starts), block_size, kv_heads, head_dim]`: for each `(row, column)`, the
        `block_size` tokens of `row` from `column` on (held tokens only), copied out of every layer's pools."""
        device = self.layers[0].key_pool.device
        rows = torch.tensor([r for r, _ in starts], device=device)[:, None]
        size = self.settings.block_size
        cols = torch.tensor([c for _, c in starts], device=device)[:, None] + torch.arange(size, device=device)
        positions = list(range(self.get_seq_length()))
        slots = {id(group): group.slots_of(positions, device)[rows, cols].reshape(-1) for group in self.groups}
        per_layer = [
            torch.stack([pool.view(-1, *pool.shape[2:]).index_select(0, slots[id(group)])
                         for pool in (layer.key_pool, layer.value_pool)])
            for layer, group in zip(self.layers, self.group_of_layer)
        ]
        return torch.stack(per_layer).unflatten(2, (len(starts), size))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a non-positive count, as assisted decoding passes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a non-positive number of tokens to remove, got {tokens_to_remove}")
        for group in self.groups:
            group.crop(-tokens_to_remove)

    def keep_tokens(self, start: int, offsets: list[int]) -> None:
        """Keep tokens `start + offsets` (increasing) at `start, start + 1, ...`, crop the rest (tree speculation)."""
        count = len(offsets)
        for group in self.groups:
            if not group.layers[0].is_initialized:
                continue
            device = group.layers[0].key_pool.device
            source = group.slots_of([start + o for o in offsets], device).reshape(-1)
            target = group.slots_of(list(range(start, start + count)), device).reshape(-1)
            for pool in (pool for layer in group.layers for pool in (layer.key_pool, layer.value_pool)):
                flat = pool.view(-1, *pool.shape[2:])  # by slot
                flat.index_copy_(0, target, flat[source])
            group.crop(group.tables.num_tokens - start - count)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        rows = beam_idx.tolist()
        for group in self.groups:
            group.tables.reorder(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for group in self.groups:
            group.tables.reorder([r for r in range(group.tables.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = torch.as_tensor(indices).tolist()
        for group in self.groups:
            group.tables.reorder(rows)

    def activate_past_recording(self) -> None:
        """Keep every step whole until the next one starts, so `crop` can take it back in sliding layers too
        (assisted decoding calls this)."""
        super().activate_past_recording()
        for group in self.groups:
            group.is_recording_past = True

    def reset(self) -> None:
        """Free every block; the pools stay allocated for the next request."""
        for group in self.groups:
            group.tables.release()
            group.plan, group.shared_rows = None, []

    def memory_bytes(self) -> int:
        """Bytes allocated for K/V pools of all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def used_bytes(self) -> int:
        """Bytes of the blocks that hold tokens (shared blocks counted once)."""
        used = 0
        for group in self.groups:
            pool = group.tables.pool
            used += sum(layer.nbytes() for layer in group.layers) * pool.num_used_blocks // max(pool.num_blocks, 1)
        return used

    def summary(self) -> dict[str, object]:
        """`CacheDisplay`'s fields plus the blocks in use over all block pools (what `repr` and Jupyter show)."""
        pools = [group.tables.pool for group in self.groups]
        used, total = sum(p.num_used_blocks for p in pools), sum(p.num_blocks for p in pools)
        return {**super().summary(), "blocks_used": f"{used}/{total}"}

