"""The LoRA slots (`hf_accel.lora.slots.AdapterSlots`): an adapter is placed once and stays resident while unused,
pinned slots are never taken, the least recently released idle adapter is evicted first, and `acquire` changes
nothing when every slot is pinned; the update of a mixed batch (the C++ kernel, and the torch path) equals each token's
own adapter's update."""

import pytest
import torch
from torch import nn

from hf_accel.kernels.custom_ops import lora_kernel
from hf_accel.lora import layers
from hf_accel.lora.adapter_files import AdapterWeights
from hf_accel.lora.layers import StepAdapters, lora_projections
from hf_accel.lora.slots import AdapterSlots


def adapter(name: str, rank: int, seed: int, in_features: int = 6, out_features: int = 5) -> AdapterWeights:
    generator = torch.Generator().manual_seed(seed)
    return AdapterWeights(name, f"/adapters/{name}", {"proj": (torch.randn(rank, in_features, generator=generator),
                                                               torch.randn(out_features, rank, generator=generator))})


def test_slots_pin_keep_and_evict_least_recently_released():
    step = StepAdapters(8, torch.device("cpu"))
    _, projections = lora_projections({"proj": nn.Linear(6, 5)}, max_loras=2, max_rank=4, step=step)
    projection = projections["proj"]
    slots = AdapterSlots({"proj": projection}, max_loras=2)
    one, two, three = adapter("one", 2, 1), adapter("two", 4, 2), adapter("three", 3, 3)
    assert slots.acquire(1, one) == 0 and slots.acquire(2, two) == 1 and slots.acquire(1, one) == 0
    assert slots.acquire(3, three) is None and slots.ranks == [2, 4]  # both pinned: nothing changes
    slots.release(2)  # idle, still resident
    slots.release(1)  # one pin left
    assert slots.acquire(3, three) == 1 and slots.slot_of(2) is None and slots.ranks == [2, 3]
    slots.release(1)
    slots.release(3)
    assert slots.acquire(2, two) == 0  # "one" was released before "three": it goes
    assert slots.slot_of(1) is None and slots.slot_of(3) == 1 and slots.ranks == [4, 3]
    slot = slots.slot_of(3)
    assert torch.equal(projection.a[slot, :3], three.modules["proj"][0]) and not projection.a[slot, 3:].any()
    assert projection.ranks.tolist() == [4, 3]
    assert slots.acquire(3, three) == 1
    slots.evict(3)  # pinned: stays while it is used
    assert slots.slot_of(3) == 1
    slots.release(3)  # its last release frees the slot, for the next adapter, without evicting "two"
    assert slots.slot_of(3) is None and slots.acquire(1, one) == 1 and slots.slot_of(2) == 0
    slots.release(1)
    slots.evict(1)  # idle: freed at once
    assert slots.slot_of(1) is None and slots.acquire(3, three) == 1


@pytest.mark.parametrize("path", ["kernel", "torch", "compiled"])
def test_the_update_is_each_tokens_own_adapters(path, monkeypatch):
    """Each token gets its own adapter's update (a base token none), through the kernel, the torch form, and the
    always-on hooks of a compiled step (the buffer past the step's tokens and between steps is -1)."""
    if path == "torch":
        monkeypatch.setattr(layers, "lora_kernel", lambda: None)
    elif lora_kernel() is None:
        pytest.skip("hf_accel's C++ extension is not built")
    step = StepAdapters(16, torch.device("cpu"), compiled=path == "compiled")
    linear = nn.Linear(6, 5)
    _, projections = lora_projections({"proj": linear}, max_loras=3, max_rank=4, step=step)
    projection = projections["proj"]
    slots = AdapterSlots({"proj": projection}, max_loras=3)
    weights = {1: adapter("one", 2, 1), 2: adapter("two", 4, 2)}
    token_slots = [slots.acquire(1, weights[1]), -1, slots.acquire(2, weights[2]), slots.acquire(1, weights[1])]
    x = torch.randn(1, 4, 6)
    step.set(token_slots, slots.ranks)
    assert step.token_slots[4:].eq(-1).all()
    with torch.no_grad():  # the engine's steps: the kernel adds in place
        out = linear(x)
        step.clear()
        base = linear(x)
    for t, lora_id in enumerate([1, None, 2, 1]):
        want = base[0, t] if lora_id is None else \
            base[0, t] + x[0, t] @ weights[lora_id].modules["proj"][0].T @ weights[lora_id].modules["proj"][1].T
        torch.testing.assert_close(out[0, t], want)
    assert step.token_slots.eq(-1).all() and step.active is None


def test_the_kernel_covers_long_chunks_wide_rows_and_odd_ranks():
    """The kernel's every path against the torch form: 41 tokens over 3 adapters (chunks of 16 and runs of 4, 3 and
    2), ranks 16 and 7 (not a multiple of the 4 rows taken together), `in` 70 and `out` 150 (blocks of 64
    and of 16 columns and a tail), base tokens between."""
    if lora_kernel() is None:
        pytest.skip("hf_accel's C++ extension is not built")
    step = StepAdapters(64, torch.device("cpu"))
    linear = nn.Linear(70, 150)
    _, projections = lora_projections({"proj": linear}, max_loras=3, max_rank=16, step=step)
    slots = AdapterSlots(projections, max_loras=3)
    weights = {i + 1: adapter(f"a{i}", rank, i, 70, 150) for i, rank in enumerate((16, 7, 16))}
    placed = {lora_id: slots.acquire(lora_id, w) for lora_id, w in weights.items()}
    # 19 tokens (a chunk of 16, a run of 3), 7 (4 + 3), 10 (4 + 4 + 2) and 5 of the base, interleaved
    ids = [([1] * 19 + [2] * 7 + [3] * 10 + [None] * 5)[t * 17 % 41] for t in range(41)]
    x = torch.randn(41, 70)
    step.set([-1 if i is None else placed[i] for i in ids], slots.ranks)
    with torch.no_grad():
        out = linear(x)
        step.clear()
        base = linear(x)
    want = torch.stack([base[t] if i is None else base[t] + x[t] @ weights[i].modules["proj"][0].T
                        @ weights[i].modules["proj"][1].T for t, i in enumerate(ids)])
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_a_step_with_more_tokens_than_the_buffer_grows_it():
    step = StepAdapters(2, torch.device("cpu"))
    step.set([0, -1, 0], [3])
    assert step.token_slots.tolist() == [0, -1, 0] and step.active.num_tokens == 3 and step.active.rank == 3
    step.set([-1, -1, -1], [3])  # base tokens only: nothing active
    assert step.active is None and step.token_slots.eq(-1).all()


def test_every_projections_stacks_are_views_of_three_buffers():
    """Projections of different shapes share the stacks' buffers without overlapping: placing an adapter in one
    writes its region only (a compiled step takes the three buffers as inputs)."""
    step = StepAdapters(4, torch.device("cpu"))
    stacks, projections = lora_projections({"q": nn.Linear(6, 5), "down": nn.Linear(5, 7)}, max_loras=2, max_rank=3,
                                           step=step)
    assert stacks.a.numel() == 2 * 3 * (6 + 5) and stacks.b.numel() == 2 * 3 * (5 + 7)
    q, down = projections["q"], projections["down"]
    generator = torch.Generator().manual_seed(0)
    update = (torch.randn(2, 5, generator=generator), torch.randn(7, 2, generator=generator))
    down.place(1, update)
    assert not q.a.any() and not q.b.any() and q.ranks.tolist() == [0, 0]
    assert torch.equal(down.a[1, :2], update[0]) and torch.equal(down.b[1, :2], update[1].T)
    assert stacks.ranks.tolist() == [[0, 0], [0, 2]] and down.a.data_ptr() == stacks.a[2 * 3 * 6:].data_ptr()
