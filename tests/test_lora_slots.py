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
from hf_accel.lora.layers import LoRAProjection, StepAdapters
from hf_accel.lora.slots import AdapterSlots


def adapter(name: str, rank: int, seed: int) -> AdapterWeights:
    generator = torch.Generator().manual_seed(seed)
    return AdapterWeights(name, f"/adapters/{name}", {"proj": (torch.randn(rank, 6, generator=generator),
                                                               torch.randn(5, rank, generator=generator))})


def test_slots_pin_keep_and_evict_least_recently_released():
    step = StepAdapters()
    projection = LoRAProjection(nn.Linear(6, 5), max_loras=2, max_rank=4, step=step)
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


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_the_update_is_each_tokens_own_adapters(path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(layers, "lora_kernel", lambda: None)
    elif lora_kernel() is None:
        pytest.skip("hf_accel's C++ extension is not built")
    step = StepAdapters()
    linear = nn.Linear(6, 5)
    projection = LoRAProjection(linear, max_loras=3, max_rank=4, step=step)
    slots = AdapterSlots({"proj": projection}, max_loras=3)
    weights = {1: adapter("one", 2, 1), 2: adapter("two", 4, 2)}
    token_slots = [slots.acquire(1, weights[1]), -1, slots.acquire(2, weights[2]), slots.acquire(1, weights[1])]
    x = torch.randn(1, 4, 6)
    step.set(token_slots, slots.ranks, torch.device("cpu"))
    with torch.no_grad():  # the engine's steps: the kernel adds in place
        out = linear(x)
        step.clear()
        base = linear(x)
    for t, lora_id in enumerate([1, None, 2, 1]):
        want = base[0, t] if lora_id is None else \
            base[0, t] + x[0, t] @ weights[lora_id].modules["proj"][0].T @ weights[lora_id].modules["proj"][1].T
        torch.testing.assert_close(out[0, t], want)
