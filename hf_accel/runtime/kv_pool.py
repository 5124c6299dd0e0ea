"""The engine's K/V storage: one preallocated tensor per layer for keys and one for values, addressed by slot.

Layout per layer: `[kv_heads, num_blocks, block_size, head_dim]`, heads outermost, so gathering a sequence's blocks
gives each head's keys as one contiguous `[tokens, head_dim]` slab (what attention kernels read fastest; measured 4x
faster than a token-major pool on CPU). Token `t` of a sequence lives at slot
`block_ids[t // block_size] * block_size + t % block_size` of the flat `[kv_heads, num_slots, head_dim]` view.
Allocated once; block ids come from the `BlockManager`.
"""

from __future__ import annotations

import torch

from ..cache.kv_shape import KVShape


class KVPool:
    """Per-layer key and value slot tensors for `num_blocks` blocks of `block_size` tokens (plus `spare_block`)."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 spare_block: bool = False):
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        # one block past the allocator's, written by the padded rows of captured steps and never read
        self.spare_block = num_blocks if spare_block else None
        size = (shape.kv_heads, num_blocks + spare_block, block_size, shape.head_dim)
        # keys[layer], values[layer]: [kv_heads, num_blocks, block_size, head_dim]
        self.keys = [static_sizes(torch.zeros(size, dtype=dtype, device=device)) for _ in range(shape.num_layers)]
        self.values = [static_sizes(torch.zeros(size, dtype=dtype, device=device)) for _ in range(shape.num_layers)]

    def move_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy every layer's K/V at pool slots `sources` `[n]` to slots `targets` `[n]` (all sources are read before
        any target is written, so the two may overlap): a verified tree's accepted path moved into place."""
        for pools in (self.keys, self.values):
            for pool in pools:
                flat = pool.view(pool.shape[0], -1, pool.shape[-1])  # [kv_heads, slots, head_dim]
                flat.index_copy_(1, targets, flat.index_select(1, sources))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


def static_sizes(tensor: torch.Tensor, dims: tuple[int, ...] = (0, 2, 3)) -> torch.Tensor:
    """`tensor`, its sizes at `dims` marked static for dynamo (a pool's kv_heads, block_size and head_dim: fixed by
    the model and the pool; only the number of blocks varies between pools). A graph compiled with `dynamic=True`
    otherwise gives each of them its own symbol and proves every reshape over them."""
    for dim in dims:
        torch._dynamo.mark_static(tensor, dim)
    return tensor


def token_slots(block_ids: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """Pool slots of a sequence's tokens `start .. stop - 1` (its `block_ids`, blocks of `block_size`)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]
