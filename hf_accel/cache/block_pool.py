"""Block allocator: a free list and reference counts over block ids. Plain Python, no torch.

The tensors that hold the blocks live elsewhere (one per layer); this module only decides which ids are in use.
Rules:
- a block is free exactly when its reference count is 0;
- `allocate` hands out the lowest free ids, or a requested consecutive run when all of it is free;
- `share` adds a reference, `free` drops one; dropping a reference from a free block is a programming error.
"""

from __future__ import annotations

import bisect
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
        self._free: list[int] = list(range(num_blocks))  # sorted ascending

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def lowest_free_block(self) -> int | None:
        return self._free[0] if self._free else None

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def can_allocate(self, num: int) -> bool:
        return self.growable or num <= self.num_free_blocks

    def grow(self, num: int) -> None:
        """Append `num` free blocks at the end of the id range."""
        start = self.num_blocks
        self._refcounts.extend([0] * num)
        self._free.extend(range(start, start + num))

    def allocate(self, num: int, start: int | None = None) -> list[int]:
        """Take `num` blocks with one reference each: `start .. start + num - 1` if all free, else the lowest free."""
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
        for block in blocks:
            self._refcounts[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (each must be in use)."""
        for block in blocks:
            assert self._refcounts[block] > 0, f"share of free block {block}"
            self._refcounts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks whose count reaches 0 return to the free list."""
        for block in blocks:
            assert self._refcounts[block] > 0, f"double free of block {block}"
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                bisect.insort(self._free, block)

    def _is_free_run(self, start: int, num: int) -> bool:
        if start < 0 or start + num > self.num_blocks:
            return False
        lo = bisect.bisect_left(self._free, start)
        return lo + num <= len(self._free) and self._free[lo + num - 1] == start + num - 1
