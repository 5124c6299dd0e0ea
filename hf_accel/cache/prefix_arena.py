"""PrefixArena: where a `PrefixStore` keeps its blocks' K/V, one tensor for all of them.

`data`: `[num_layers, 2 (K, V), capacity, block_size, kv_heads, head_dim]`. A block lives in one slot of dim 2 from
`allocate` until `free`; freed slots are reused first. Capacity doubles when no slot is free, up to `max_slots`. One
tensor instead of a tensor per block lets a hit read consecutive slots as a view (no gather) and lets `save` write
blocks straight out of a paged cache's pools. Not thread-safe: the store calls it under its lock, and the tensor may
be reallocated by `allocate`, so callers read `data` only while they hold that lock.
"""

from __future__ import annotations

import torch

from .kv_shape import KVShape


class PrefixArena:
    """Slots for up to `max_slots` blocks of `block_size` tokens of a model of `shape`, in `dtype` on `device`."""

    def __init__(self, shape: KVShape, block_size: int, max_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if max_slots < 1:
            raise ValueError(f"`max_slots` must be at least 1, got {max_slots}")
        self.max_slots = max_slots
        size = (shape.num_layers, 2, 0, block_size, shape.kv_heads, shape.head_dim)
        self.data = torch.zeros(size, dtype=dtype, device=device)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (used and free slots)."""
        return self.data.nbytes

    def allocate(self) -> int:
        """A free slot, growing the tensor if none is; RuntimeError past `max_slots` (the store never asks for more
        than it can hold)."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def clear(self) -> None:
        """Free every slot and give the memory back (the next `allocate` starts a new tensor)."""
        self.data = self.data.new_zeros((*self.data.shape[:2], 0, *self.data.shape[3:]))
        self._free = []

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

    def _grow(self) -> None:
        capacity = self.capacity
        if capacity >= self.max_slots:
            raise RuntimeError(f"the prefix arena is full ({capacity} slots)")
        grown_to = min(max(2 * capacity, 16), self.max_slots)
        grown = self.data.new_zeros((*self.data.shape[:2], grown_to, *self.data.shape[3:]))
        grown[:, :, :capacity] = self.data
        self.data = grown
        self._free.extend(range(grown_to - 1, capacity - 1, -1))  # popped from the end: lowest slot first
