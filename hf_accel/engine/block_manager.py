"""KV blocks of the engine's sequences, with prefix caching across requests. Plain Python, no torch.

Allocation and the prefix cache are `BlockPool`'s (the paged cache's allocator): a full block is cached under its
`block_key` (cache/block_hash.py), so equal keys mean equal prefixes. This module adds per-sequence block lists.
Rules:
- a cached block that no sequence uses is free: it waits at the back of the pool's free queue and is evicted least
  recently freed first, only after every uncached free block is taken;
- a sequence reuses cached blocks only for tokens before its last one (the last token must be computed to sample);
- a block is written only while its sole reference is the writing sequence (cached blocks are full, never written);
- `allocate` checks the whole need first and changes nothing when it cannot be met.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.block_hash import block_keys
from ..cache.block_pool import BlockPool
from .sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since the engine started: `queries` / `hits` in tokens, as vLLM's `prefix_cache_*` metrics."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Blocks of every sequence, over one `BlockPool` of `num_blocks` blocks of `block_size` tokens.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep full blocks of finished sequences for reuse by later ones.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._seq_keys: dict[int, list[bytes]] = {}  # seq_id -> keys of its leading full blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could get now: free ones, cached ones no sequence uses included."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (evictable cached blocks count as free), as `kv_cache_usage_perc`."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(-(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_ids), 0)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the leading full blocks of `seq` (all but its last token), in order."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for key in block_keys(seq.token_ids[: seq.num_tokens - 1], self.block_size, seq.request.prefix_root):
            block = self.pool.cached_block(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_with_prefix(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Give a sequence with no blocks its cached prefix plus blocks for `num_new_tokens` more tokens, leaving at
        least `reserve` blocks free. Sets `num_computed_tokens` to the cached length. False (and no change) if the
        blocks are not there."""
        assert not seq.block_ids and seq.num_computed_tokens == 0, "sequence already holds blocks"
        hits = self.match_prefix(seq)
        num_new = max(min(num_new_tokens, seq.num_tokens - len(hits) * self.block_size), 0)
        need = -(-(len(hits) * self.block_size + num_new) // self.block_size) - len(hits)
        if need + reserve > self.num_free_blocks - sum(1 for b in hits if self.pool.refcount(b) == 0):
            return False
        self.pool.share(hits)
        seq.block_ids = hits + self.pool.allocate(need)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.stats.queries += seq.num_tokens
        self.stats.hits += seq.num_computed_tokens
        self._seq_keys[seq.seq_id] = [self.pool.key_of(b) for b in hits]
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for `num_new_tokens` more tokens of a sequence; False (and no change) if they are not there."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        seq.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the sequence's blocks that became full of computed tokens (call after each step)."""
        if not self.enable_prefix_caching:
            return
        keys = self._seq_keys.setdefault(seq.seq_id, [])
        new_tokens = seq.token_ids[len(keys) * self.block_size : seq.num_computed_tokens]
        parent = keys[-1] if keys else seq.request.prefix_root
        for j, key in enumerate(block_keys(new_tokens, self.block_size, parent), len(keys)):
            keys.append(key)
            self.pool.cache_block(seq.block_ids[j], key)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks (last block first, so a prefix outlives its tails in the eviction order)."""
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_computed_tokens = 0
        self._seq_keys.pop(seq.seq_id, None)
