"""Weight-only quantization math and modules: exact packing, error bounds, kernel path == plain-torch fallback."""

import pytest
import torch
from torch import nn

from hf_accel import Int4Linear, Int8Linear
from hf_accel.quant import weights


@pytest.fixture
def weight():
    return torch.randn(48, 128, generator=torch.Generator().manual_seed(0))


def test_int8_words_round_trip_exactly(weight):
    codes, _ = weights.quantize_int8(weight)
    words = weights.pack_words(codes, 8)
    assert words.dtype == torch.int32 and words.shape == (48, 32)
    assert torch.equal(weights.unpack_words(words, 8), codes)


def test_int4_words_round_trip_exactly_with_even_inputs_in_low_nibbles(weight):
    codes, _ = weights.quantize_int4(weight, 32)
    words = weights.pack_words(codes, 4)
    assert words.shape == (48, 16)
    assert torch.equal(weights.unpack_words(words, 4), codes)
    first_byte = words.view(torch.uint8)[0, 0]
    assert first_byte == codes[0, 0] | (codes[0, 1] << 4)


def test_int8_error_is_at_most_half_a_step(weight):
    codes, scale = weights.quantize_int8(weight)
    error = (weights.dequantize_int8(codes, scale, torch.float32) - weight).abs()
    assert int(codes.abs().max()) == 127
    assert bool((error <= scale[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step_per_group(weight, group_size):
    codes, qparams = weights.quantize_int4(weight, group_size)
    assert qparams.shape == (128 // group_size, 48, 2) and int(codes.max()) <= 15
    error = (weights.dequantize_int4(codes, qparams, torch.float32) - weight).abs()
    step = qparams[..., 0].t().repeat_interleave(group_size, dim=1)
    assert bool((error <= step / 2 + 1e-5).all())


@pytest.mark.parametrize("group_size", [48, 16, 512])
def test_int4_group_size_must_be_allowed_and_divide_in_features(group_size):
    with pytest.raises(ValueError, match="group_size"):
        Int4Linear(128, 64, group_size=group_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_path_and_fallback_agree(bits, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True).to(dtype)
    module = Int8Linear.from_float(linear) if bits == 8 else Int4Linear.from_float(linear, group_size=32)
    x = torch.randn(3, 5, 128, dtype=dtype)
    kernel, fallback = module(x), module(x, use_kernel=False)
    reference = nn.functional.linear(x.float(), module.dequantized_weight(torch.float32), module.bias.float())
    assert kernel.shape == (3, 5, 64) and kernel.dtype == dtype
    for other in (fallback.float(), reference):  # the kernels compute in bf16: relative error ~ bf16 rounding
        assert ((kernel.float() - other).norm() / other.norm()).item() < 1e-2


@pytest.mark.parametrize(("bits", "kernel_switch", "layout"), [(4, "1", "panels"), (4, "0", "cpu"), (8, "1", "panels")])
def test_kernel_layout_reads_back_exactly_and_saves_the_checkpoint_format(monkeypatch, bits, kernel_switch, layout):
    monkeypatch.setenv("HF_ACCEL_PAGED_KERNEL", kernel_switch)  # "0": hf_accel's kernels off, torch's int4 kernel
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=False)
    module = Int4Linear.from_float(linear, group_size=64) if bits == 4 else Int8Linear.from_float(linear)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    codes = module.codes()
    module(torch.randn(1, 128))  # re-lays the weight out for the CPU kernel
    assert module.layout == layout
    assert torch.equal(module.codes(), codes)
    after = module.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    module.load_state_dict(before)
    assert module.layout is None and torch.equal(module.codes(), codes)


def test_quantized_linear_is_close_to_float():
    torch.manual_seed(0)
    linear = nn.Linear(256, 64)
    x = torch.randn(4, 256)
    relative = {}
    for bits, module in ((8, Int8Linear.from_float(linear)), (4, Int4Linear.from_float(linear, group_size=32))):
        relative[bits] = ((module(x) - linear(x)).norm() / linear(x).norm()).item()
    assert relative[8] < 0.01 and relative[4] < 0.1


def test_int8_in_features_must_fill_whole_words():
    with pytest.raises(ValueError, match="multiple of 4"):
        Int8Linear(30, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_kernel_path_and_fallback_agree(bits):
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False).to("cuda", torch.bfloat16)
    module = Int8Linear.from_float(linear) if bits == 8 else Int4Linear.from_float(linear, group_size=64)
    codes = module.codes() if bits == 4 else None
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(module(x).float(), module(x, use_kernel=False).float(), atol=0.1, rtol=0.05)
    if bits == 4:
        module(x)
        assert module.layout == "cuda" and torch.equal(module.codes(), codes)


def test_int8_kernel_gets_aligned_weights_and_inputs_even_from_unaligned_memory():
    """The CPU int8 kernel crashes on unaligned memory (a memory-mapped checkpoint, a sliced activation)."""
    torch.manual_seed(0)
    module = Int8Linear.from_float(nn.Linear(64, 32, bias=False))
    storage = torch.empty(module.weight.numel() + 1, dtype=torch.int32)
    storage[1:] = module.weight.flatten()
    module.weight = nn.Parameter(storage[1:].view_as(module.weight), requires_grad=False)  # 4 bytes off
    x = torch.empty(2 * 64 + 2, dtype=torch.bfloat16)[2:].view(2, 64).normal_()  # 4 bytes off
    assert not weights.is_aligned(module.weight) and not weights.is_aligned(x)
    out = module(x)
    assert weights.is_aligned(module.weight)
    torch.testing.assert_close(out, module(x.clone()))
