"""Quantized panels on transparent huge pages (`csrc/huge_pages.cpp`, `quant/panel_memory.py`): a copy equals its
source, lies in a mapping the kernel may back with huge pages, and that mapping goes back to the system when its last
copy dies; a model's panels move with their siblings still end to end and give the same tokens."""

import sys
from pathlib import Path

import pytest
import torch
from conformance import PAD, make_model, make_prompts

from hf_accel import WeightOnlyConfig, quantize_model
from hf_accel.kernels.custom_ops import on_huge_pages, quantized_linear_kernels
from hf_accel.quant.panel_memory import move_panels_to_huge_pages

pytestmark = [pytest.mark.skipif(quantized_linear_kernels() is None, reason="hf_accel's kernels not built"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages: Linux mappings")]
HUGE_PAGE = 2 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_of(address: int) -> dict[str, int] | None:
    """The mapping of this process holding `address`: its start, end and smaps' THPeligible; None if none does."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            found = {"start": start, "end": end} if start <= address < end else None
        elif found is not None and line.startswith("THPeligible:"):
            found["thp_eligible"] = int(line.split()[1])
            return found
    return found


def thp_enabled() -> bool:
    return THP.is_file() and "[never]" not in THP.read_text()


@pytest.mark.parametrize("source", [torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),  # not contiguous
                                    torch.randint(-128, 127, (3, 64, 16), dtype=torch.int8),
                                    torch.randn(5, 3).half(), torch.empty(0, 16, dtype=torch.uint8)],
                         ids=["fp32-transposed", "int8", "fp16", "empty"])
def test_a_copy_equals_its_source(source):
    copy = on_huge_pages(source)
    assert copy.dtype == source.dtype and copy.shape == source.shape and copy.is_contiguous()
    assert torch.equal(copy, source)
    assert copy.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert copy.data_ptr() % 64 == 0


def test_a_large_copy_gets_its_own_huge_page_mapping_which_dies_with_it():
    source = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)  # past a shared slab's quarter: its own
    copy = on_huge_pages(source)
    address = copy.data_ptr()
    assert address % HUGE_PAGE == 0 and torch.equal(copy, source)
    mapping = mapping_of(address)
    assert mapping["start"] <= address and mapping["end"] >= address + copy.nbytes
    if thp_enabled():
        assert mapping["thp_eligible"] == 1
    view = copy[1 << 20:]
    del copy
    assert mapping_of(address) is not None  # a view still holds it
    del view
    assert mapping_of(address) is None  # unmapped with its last user


def test_small_copies_are_laid_one_after_another_in_a_slab():
    copies = [on_huge_pages(torch.full((1000, 16), float(i))) for i in range(3)]  # 64000 bytes each
    addresses = [c.data_ptr() for c in copies]
    assert addresses[1] - addresses[0] == addresses[2] - addresses[1] == 64000
    mapping = mapping_of(addresses[0])
    assert mapping["end"] >= addresses[2] + 64000
    if thp_enabled():
        assert mapping["thp_eligible"] == 1
    assert all(torch.equal(c, torch.full((1000, 16), float(i))) for i, c in enumerate(copies))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_models_panels_move_with_their_siblings_and_keep_their_tokens(bits):
    model = quantize_model(make_model("llama", torch.float32, "sdpa"), WeightOnlyConfig(bits=bits))
    inputs = make_prompts([9, 13], seed=2)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    tokens, state = model.generate(**inputs, **kwargs), {k: v.clone() for k, v in model.state_dict().items()}
    attention = model.model.layers[0].self_attn
    before = attention.q_proj.weight.untyped_storage().data_ptr()
    assert move_panels_to_huge_pages(model) > 0
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert q.untyped_storage().data_ptr() != before  # moved ...
    assert len({t.untyped_storage().data_ptr() for t in (q, k, v)}) == 1  # ... together, still end to end
    assert k.storage_offset() == q.storage_offset() + q.numel()
    if thp_enabled():
        assert mapping_of(q.data_ptr())["thp_eligible"] == 1
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[name], after[name]) for name in state)
    assert torch.equal(model.generate(**inputs, **kwargs), tokens)
