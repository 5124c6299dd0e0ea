"""PrefixArena: growth by doubling up to `max_slots` as slots are written, reads as a view when slots are
consecutive and as a gather otherwise, the same values either way."""

import pytest
import torch

from hf_accel.cache.prefix_arena import PrefixArena
from hf_accel.cache.kv_shape import KVShape

SHAPE = KVShape(num_layers=2, kv_heads=2, head_dim=4)


def filled(arena: PrefixArena, slots: list[int]) -> list[int]:
    """Write `slots`, slot s holding the value s everywhere."""
    for slot in slots:
        arena.write(slot, torch.full((2, 2, 3, 2, 4), float(slot)))
    return slots


def test_growth_doubles_up_to_max_slots_and_keeps_what_was_written():
    arena = PrefixArena(SHAPE, block_size=3, max_slots=20, dtype=torch.float32)
    filled(arena, list(range(16)))
    assert arena.capacity == 16
    filled(arena, [5])
    assert arena.capacity == 16
    filled(arena, [16, 17, 18, 19])
    assert arena.capacity == 20  # doubling capped at max_slots
    assert torch.equal(arena.data[:, :, 3], torch.full_like(arena.data[:, :, 3], 3.0))  # kept through growth
    with pytest.raises(RuntimeError, match="past the prefix arena's 20 slots"):
        filled(arena, [20])
    arena.clear()
    assert arena.nbytes == 0  # memory given back
    filled(arena, [0])
    assert arena.capacity == 16


def test_read_is_a_view_for_consecutive_slots_and_a_gather_otherwise():
    arena = PrefixArena(SHAPE, block_size=3, max_slots=8, dtype=torch.float32)
    filled(arena, list(range(6)))
    view = arena.read([1, 2, 3], torch.device("cpu"))
    assert view.shape == (2, 2, 9, 2, 4) and view.data_ptr() == arena.data[:, :, 1].data_ptr()
    gathered = arena.read([4, 0, 2], torch.device("cpu"))
    assert gathered.data_ptr() != arena.data.data_ptr()
    assert gathered[0, 1, :, 0, 0].tolist() == [4.0] * 3 + [0.0] * 3 + [2.0] * 3


def test_max_slots_must_be_positive():
    with pytest.raises(ValueError, match="max_slots"):
        PrefixArena(SHAPE, block_size=3, max_slots=0, dtype=torch.float32)
