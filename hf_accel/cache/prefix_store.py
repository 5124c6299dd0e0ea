"""PrefixStore: full prompt blocks kept across plain `generate` calls, so a later prompt that starts with them skips
their prefill.

Used through the paged cache: `model.generate(**inputs, cache_implementation="paged", cache_config={"prefix_store":
store})` (or `PagedCache(model.config, prefix_store=store)`). Around generate's prefill (hf_accel/registry.py):
- `load`: row `r` of the batch has `p_r` left-pad columns and its real tokens start with `h_r` stored tokens (whole
  blocks, keyed by `block_keys`, never the row's last token). The cache is filled with the first
  `k = min_r(p_r + h_r)` columns (at most `width - 1`): zeros for pads (masked, never attended), stored K/V for the
  rest. generate then computes only columns `k ..`; a row with a longer hit recomputes a few of its tokens.
- `save`: every row's full blocks of real tokens that the store lacks are copied out of the cache, all layers.
The store deals only in keys and tensors: the cache reads and writes its own pools (`PagedCache.fill_columns`,
`gather_blocks`) and hands the store those two functions.
Stored keys are post-RoPE. That is valid at any padding because generate's position ids start at 0 at each row's
first real token (`attention_mask.cumsum(-1) - 1`). Sliding-window layers keep every prompt token while the prefill
runs, so their blocks can be stored too.

The index is a `BlockPool` of `max_memory // block bytes` slots (the allocator and prefix index the engine uses):
every stored block is a free, cached slot, so the pool's free queue is the least-recently-used order. A hit or a save
makes a chain's blocks the most recent, its first block last, so a block is never evicted before its descendants;
a block's K/V live in one `PrefixArena` tensor at its slot, so a hit whose blocks were saved together reads them as
one view, copied once into the cache's pools. The lock guards the index and the arena: slots are reused after
eviction, so `load` reads them under it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from ..display import RichDisplay, format_bytes
from .block_hash import block_keys
from .block_pool import BlockPool
from .kv_shape import ATTENTION_KINDS, KVShape
from .paged_config import parse_bytes
from .prefix_arena import PrefixArena
from .settings import check_int


@dataclass(slots=True)
class PrefixStoreStats:
    """Counts since the store was made. `hits` / `misses`: cache rows (prompts x beams / return sequences) whose prompt
    did / did not start with a stored block; `tokens_saved`: real prompt tokens not computed; `blocks` / `bytes`: what
    the store holds now; `evictions`: blocks evicted to stay within `max_bytes`."""

    hits: int
    misses: int
    tokens_saved: int
    blocks: int
    bytes: int
    max_bytes: int
    evictions: int


class PrefixStore(RichDisplay):
    """Full prompt blocks of one model, kept across `generate` calls and evicted least recently used first.

    Args:
        model: the model whose K/V it holds (its config, dtype and layers; the store refuses any other model).
        max_memory: bytes the stored K/V may take (int or a string such as `"1GiB"`).
        block_size: tokens per block; the paged cache that uses the store must have the same `block_size`.

    Thread-safe: one store may serve several threads generating at once.
    Example: `store = PrefixStore(model, max_memory="1GiB")`, then
    `model.generate(**inputs, cache_implementation="paged", cache_config={"prefix_store": store})`.
    """

    def __init__(self, model: PreTrainedModel, max_memory: int | str = "1GiB", block_size: int = 16):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"`model` must be a transformers PreTrainedModel, got {type(model).__name__}")
        check_int("block_size", block_size, 1, "a positive int")
        self.block_size = block_size
        self.shape = KVShape.from_config(model.config, ATTENTION_KINDS, "PrefixStore", "model")
        self.dtype = model.dtype
        self.config = model.config
        self._model = weakref.ref(model)
        self.block_bytes = self.shape.bytes_per_token(self.dtype) * block_size
        max_bytes = parse_bytes(max_memory)
        if max_bytes < self.block_bytes:
            raise ValueError(f"`max_memory` ({max_bytes} bytes) is below one block of this model "
                             f"({self.block_bytes} bytes at block_size={block_size}, {self.dtype})")
        self.max_bytes = max_bytes
        # the prefix index: a slot per stored block, keyed by `block_keys`; every stored block is free and cached, so
        # the pool's free queue is the eviction order (least recently used first)
        self._slots = BlockPool(max_bytes // self.block_bytes)
        self._arena = PrefixArena(self.shape, block_size, self._slots.num_blocks, self.dtype, model.device)
        self._lock = threading.Lock()
        self._hits = self._misses = self._tokens_saved = 0

    def __deepcopy__(self, memo: dict) -> PrefixStore:
        return self  # generate may copy its config (cache_config included); the store is shared state, never copied

    def check_cache(self, config: PreTrainedConfig, block_size: int) -> None:
        """ValueError unless a paged cache for `config` with `block_size` tokens per block can use this store."""
        if config is not self.config:
            raise ValueError("`prefix_store` was built for another model; build one PrefixStore per model")
        if block_size != self.block_size:
            raise ValueError(f"`block_size` of the paged cache ({block_size}) must equal the prefix_store's "
                             f"block_size ({self.block_size})")
        model = self._model()
        if model is not None and model.dtype != self.dtype:
            raise ValueError(f"`prefix_store` holds {self.dtype} K/V but the model now runs in {model.dtype}; "
                             "build a new PrefixStore for it")

    def stats(self) -> PrefixStoreStats:
        """Hits, misses, tokens saved, blocks and bytes held, evictions."""
        with self._lock:
            blocks = self._slots.num_cached_blocks
            return PrefixStoreStats(self._hits, self._misses, self._tokens_saved, blocks, blocks * self.block_bytes,
                                    self.max_bytes, self._slots.num_evictions)

    def clear(self) -> None:
        """Forget every stored block (counters stay)."""
        with self._lock:
            evictions, self._slots = self._slots.num_evictions, BlockPool(self._slots.num_blocks)
            self._slots.num_evictions = evictions
            self._arena.clear()

    def summary(self) -> dict[str, object]:
        """What `repr` and Jupyter show: block size, blocks, memory used / allowed, hits, misses, tokens saved."""
        stats = self.stats()
        return {"block_size": self.block_size, "blocks": stats.blocks,
                "memory": f"{format_bytes(stats.bytes)} / {format_bytes(stats.max_bytes)}", "hits": stats.hits,
                "misses": stats.misses, "tokens_saved": stats.tokens_saved, "evictions": stats.evictions}

    def load(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             fill_columns: Callable[[torch.Tensor], None]) -> list[list[bytes]] | None:
        """Hand `fill_columns` the stored columns every row of `input_ids` `[rows, width]` starts with, as
        `[num_layers, 2, rows, columns, kv_heads, head_dim]` (see the module docstring; called under the lock, as the
        tensor may view the arena); no call when no row hits. Returns each row's chain of full-block keys, for `save`
        after the prefill (None when the padding is not left padding: nothing is loaded or saved)."""
        pads = left_padding(input_ids, attention_mask)
        if pads is None:
            return None
        width, chains = input_ids.shape[1], self._chains(input_ids, pads)
        with self._lock:
            # never the row's last token: it must be computed to sample from
            hits = [self._match(chain[: (width - pad - 1) // self.block_size]) for chain, pad in zip(chains, pads)]
            skip = min(min(pad + len(hit) * self.block_size for pad, hit in zip(pads, hits)), width - 1)
            self._hits += sum(1 for hit in hits if hit)
            self._misses += sum(1 for hit in hits if not hit)
            self._tokens_saved += sum(max(skip - pad, 0) for pad in pads) if skip > min(pads) else 0
            if skip > min(pads):  # some row skips real tokens
                fill_columns(self._stored_columns(hits, pads, skip, input_ids.device))
        return chains

    def save(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             gather_blocks: Callable[[list[tuple[int, int]]], torch.Tensor],
             chains: list[list[bytes]] | None = None) -> None:
        """Store every row's full blocks of real tokens that the store lacks, read by `gather_blocks((row, first
        column) pairs)` as `[num_layers, 2, blocks, block_size, kv_heads, head_dim]` from a cache holding the prompt
        `input_ids` `[rows, width]` in full. `chains`: what `load` returned for these rows, if it ran (saves hashing
        the prompt twice)."""
        pads = left_padding(input_ids, attention_mask)
        if pads is None:
            return
        chains = self._chains(input_ids, pads) if chains is None else chains
        wanted: dict[bytes, tuple[int, int]] = {}  # key -> (row, first column) of the blocks the store lacks
        with self._lock:
            for r, (chain, pad) in enumerate(zip(chains, pads)):
                for j, key in enumerate(chain):
                    if self._slots.cached_block(key) is None and key not in wanted:
                        wanted[key] = (r, pad + j * self.block_size)
        if not wanted:
            return
        # [num_layers, 2, blocks, block_size, kv_heads, head_dim], in `wanted` order
        blocks = gather_blocks(list(wanted.values()))
        position = {key: i for i, key in enumerate(wanted)}
        with self._lock:
            for chain in chains:
                self._insert(chain, blocks, position)

    def _match(self, chain: list[bytes]) -> list[int]:
        """Slots of the longest stored start of `chain`, made the most recently used (the first block last)."""
        slots = []
        for key in chain:
            slot = self._slots.cached_block(key)
            if slot is None:
                break
            slots.append(slot)
        self._slots.share(slots)
        self._slots.free(reversed(slots))
        return slots

    def _insert(self, chain: list[bytes], blocks: torch.Tensor, position: dict[bytes, int]) -> None:
        """Store the blocks of `chain` found in `position` (their index in `blocks`), up to the last of them. The
        chain is held while it is stored, so storing a block never evicts its own ancestors (a chain longer than the
        store stops where it is full); released last block first, so its first block is the most recently used."""
        end = max((j + 1 for j, key in enumerate(chain) if key in position), default=0)
        held = []
        for key in chain[:end]:
            slot = self._slots.cached_block(key)
            if slot is not None:
                self._slots.share([slot])
            elif key in position and self._slots.can_allocate(1):
                (slot,) = self._slots.allocate(1)  # evicts the least recently used block when no slot is empty
                self._arena.write(slot, blocks[:, :, position[key]])
                self._slots.cache_block(slot, key)
            else:
                break  # evicted meanwhile, or the store is full of this chain
            held.append(slot)
        self._slots.free(reversed(held))

    def _chains(self, input_ids: torch.Tensor, pads: list[int]) -> list[list[bytes]]:
        """Each row's keys of its full blocks of real tokens (`block_keys`, as the engine keys its blocks)."""
        return [list(block_keys(row[pad:], self.block_size)) for row, pad in zip(input_ids.tolist(), pads)]

    def _stored_columns(self, hits: list[list[int]], pads: list[int], skip: int,
                        device: torch.device) -> torch.Tensor:
        """`[num_layers, 2, rows, skip, kv_heads, head_dim]`: each row's first `skip` columns, zeros for pad columns
        (masked, never attended) then the row's stored K/V. Called under the lock (it reads the arena); one unpadded
        row (the common case) may be a view of the arena."""
        shape, block_size, rows = self.shape, self.block_size, []
        for pad, hit in zip(pads, hits):
            stored = max(skip - pad, 0)  # real tokens of this row before column `skip`, all in its hit blocks
            slots = hit[: -(-stored // block_size)]
            # [num_layers, 2, stored, kv_heads, head_dim], front-padded to `skip` columns
            row = self._arena.read(slots, device)[:, :, :stored] if slots else None
            if stored < skip:
                zeros = torch.zeros((shape.num_layers, 2, skip - stored, shape.kv_heads, shape.head_dim),
                                    dtype=self.dtype, device=device)
                row = zeros if row is None else torch.cat([zeros, row], dim=2)
            rows.append(row)
        return rows[0].unsqueeze(2) if len(rows) == 1 else torch.stack(rows, dim=2)

def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int] | None:
    """Left-pad columns of each row (`attention_mask` None: no padding); None when some row's mask is not
    `0 .. 0 1 .. 1` with at least one 1 (right padding, holes), which the store does not handle."""
    rows, width = input_ids.shape
    if attention_mask is None:
        return [0] * rows
    mask = attention_mask.to(torch.long)
    real = mask.sum(dim=1)
    pads = width - real
    expected = torch.arange(width, device=mask.device)[None, :] >= pads[:, None]
    if bool((real == 0).any()) or not torch.equal(mask.bool(), expected):
        return None
    return pads.tolist()
