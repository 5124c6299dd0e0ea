"""PrefixArena: where a `PrefixStore` keeps its blocks' K/V, one tensor for all of them.

`data`: `[num_layers, 2 (K, V), capacity, block_size, kv_heads, head_dim]`, block `slot` at index `slot` of dim 2. The
slot ids come from the store's `BlockPool` (lowest free first, reused after eviction); capacity doubles (to at least
16) up to `max_slots` when a slot past it is written. One tensor instead of a tensor per block lets a hit read
consecutive slots as a view (no gather). Not thread-safe: the store calls it under its lock, and `write` may
reallocate `data`, so callers read it only while they hold that lock.
"""

from __future__ import annotations

import torch

from .kv_shape import KVShape


class PrefixArena:
    """Room for up to `max_slots` blocks of `block_size` tokens of a model of `shape`, in `dtype` on `device`."""

    def __init__(self, shape: KVShape, block_size: int, max_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if max_slots < 1:
            raise ValueError(f"`max_slots` must be at least 1, got {max_slots}")
        self.max_slots = max_slots
        size = (shape.num_layers, 2, 0, block_size, shape.kv_heads, shape.head_dim)
        self.data = torch.zeros(size, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (used and free slots)."""
        return self.data.nbytes

    def write(self, slot: int, block: torch.Tensor) -> None:
        """Store `block` `[num_layers, 2, block_size, kv_heads, head_dim]` in `slot`, growing the tensor to hold it;
        RuntimeError for a slot past `max_slots`."""
        if slot >= self.max_slots:
            raise RuntimeError(f"slot {slot} is past the prefix arena's {self.max_slots} slots")
        if slot >= self.capacity:
            self._grow(min(max(2 * self.capacity, 16, slot + 1), self.max_slots))
        self.data[:, :, slot] = block.to(self.data.device)

    def clear(self) -> None:
        """Give the memory back (the next `write` starts a new tensor)."""
        self.data = self.data.new_zeros((*self.data.shape[:2], 0, *self.data.shape[3:]))

    def read(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """`[num_layers, 2, len(slots) * block_size, kv_heads, head_dim]` K/V of `slots` in order: a view when they are
        consecutive ascending (a prompt's blocks saved together usually are), else one gather."""
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            picked = self.data[:, :, first : first + len(slots)]
        else:
            picked = self.data.index_select(2, torch.tensor(slots, device=self.data.device))
        layers, _, num, block_size, heads, dim = picked.shape
        return picked.reshape(layers, 2, num * block_size, heads, dim).to(device)

    def _grow(self, capacity: int) -> None:
        grown = self.data.new_zeros((*self.data.shape[:2], capacity, *self.data.shape[3:]))
        grown[:, :, : self.capacity] = self.data
        self.data = grown
