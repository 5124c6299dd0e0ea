"""Block allocator: reference counts, a free queue and the keys of cached blocks, over block ids. Plain Python, no
torch. It serves the paged cache (which caches nothing) and the engine (whose prefix cache is the cached blocks).

The tensors that hold the blocks live elsewhere (one per layer); this module only decides which ids are in use.
Rules:
- a block is free exactly when its reference count is 0;
- free blocks wait in one queue: first the uncached ones, lowest id first, then the cached ones (free blocks that
  still hold a keyed prefix, see `cache_block`) in eviction order, least recently freed first (as vLLM's block pool);
- `allocate` hands out the front of the queue, or a requested consecutive run of uncached blocks when all of it is
  free; handing out a cached block evicts its key;
- `share` adds a reference, `free` drops one; sharing a free block is allowed only for a cached one (a prefix hit:
  it leaves the queue); dropping a reference from a free block is a programming error;
- a key names at most one block and a block holds at most one key; a block keeps its key until it is evicted.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable


class OutOfBlocksError(ValueError):
    """The pool cannot hold the request. Raised before anything is allocated, so nothing leaks."""

    def __init__(self, num_needed: int, num_free: int, num_blocks: int):
        self.num_needed, self.num_free, self.num_blocks = num_needed, num_free, num_blocks
        super().__init__(
            f"KV block pool exhausted: {num_needed} more blocks needed, {num_free} free of {num_blocks} in the pool. "
            "Raise `num_blocks` or `max_memory` in cache_config, or leave both unset to let the pool grow."
        )


class BlockPool:
    """Reference-counted block ids `0 .. num_blocks - 1`.

    Args:
        num_blocks: initial number of blocks.
        growable: when True, `allocate` grows the pool instead of raising `OutOfBlocksError`.
    """

    def __init__(self, num_blocks: int, growable: bool = False):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"`num_blocks` must be a non-negative int, got {num_blocks!r}")
        self.growable = growable
        self._refcounts: list[int] = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks))  # uncached free blocks, sorted ascending
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # cached free blocks, eviction order
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        self._key_of: dict[int, bytes] = {}  # cached block -> key
        self.num_evictions = 0  # cached blocks handed out by `allocate` (their keys forgotten)

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: uncached free ones and evictable cached ones."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def lowest_free_block(self) -> int | None:
        return self._free[0] if self._free else None

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def cached_block(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def cache_block(self, block: int, key: bytes) -> None:
        """Name a block in use by `key` (a full block's prefix key), unless the key or the block is named already."""
        assert self._refcounts[block] > 0, f"cache of free block {block}"
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key], self._key_of[block] = block, key

    def can_allocate(self, num: int) -> bool:
        return self.growable or num <= self.num_free_blocks

    def grow(self, num: int) -> None:
        """Append `num` free blocks at the end of the id range."""
        start = self.num_blocks
        self._refcounts.extend([0] * num)
        self._free.extend(range(start, start + num))

    def allocate(self, num: int, start: int | None = None) -> list[int]:
        """Take `num` blocks with one reference each: `start .. start + num - 1` if all free and uncached, else the
        front of the free queue."""
        if num <= 0:
            return []
        if start is not None and self._is_free_run(start, num):
            lo = bisect.bisect_left(self._free, start)
            del self._free[lo : lo + num]
            blocks = list(range(start, start + num))
        else:
            if num > self.num_free_blocks:
                if not self.growable:
                    raise OutOfBlocksError(num - self.num_free_blocks, self.num_free_blocks, self.num_blocks)
                self.grow(max(num - self.num_free_blocks, self.num_blocks))
            blocks, self._free = self._free[:num], self._free[num:]
            blocks += [self._evict_oldest() for _ in range(num - len(blocks))]
        for block in blocks:
            self._refcounts[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (each in use, or free and cached: then it leaves the free queue)."""
        for block in blocks:
            if self._refcounts[block] == 0:
                assert block in self._cached_free, f"share of free block {block} that holds no key"
                del self._cached_free[block]
            self._refcounts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in order; blocks whose count reaches 0 join the free queue (cached ones
        at its back: free a sequence's blocks last first, so its tail is evicted before its prefix)."""
        for block in blocks:
            assert self._refcounts[block] > 0, f"double free of block {block}"
            self._refcounts[block] -= 1
            if self._refcounts[block] > 0:
                continue
            if block in self._key_of:
                self._cached_free[block] = None
            else:
                bisect.insort(self._free, block)

    def _evict_oldest(self) -> int:
        block, _ = self._cached_free.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.num_evictions += 1
        return block

    def _is_free_run(self, start: int, num: int) -> bool:
        if start < 0 or start + num > self.num_blocks:
            return False
        lo = bisect.bisect_left(self._free, start)
        return lo + num <= len(self._free) and self._free[lo + num - 1] == start + num - 1
