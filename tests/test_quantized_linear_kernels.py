"""hf_accel's quantized Linear kernels (`torch.ops.hf_accel.int8_linear` / `int4_linear`, csrc/quantized_linear.cpp)
over weights re-laid in panels (`hf_accel.quant.panels`): exact layout round trips in both byte orders, products equal
to the matmul of the dequantized weight by the rows the kernel multiplies (format 1: each row quantized to int8 per
32 inputs, `quantized_rows`; format 0: the rows themselves) up to fp32 rounding at every row count (one pass, several
passes per panel, past the register kernel), every int4 group size, bf16 and strided inputs, bias; a row's result
does not depend on the other rows (format 1) and threads split the panels without changing a bit; int8 with one
scale per group of inputs (GGUF's Q8_0) in both formats, and a single group is the per-channel kernel bit for bit;
symmetric int4 (GGUF's Q4_0) keeps its scales alone and gives the same bits as (scale, minimum) panels;
`Int8Linear` / `Int4Linear` choose the panels on CPU and keep them out of `state_dict`; int8 and int4 models generate
with `compile_config` (int8 + compile used to crash in dynamo) token for token as they do eagerly."""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from tiny_llama import tiny_llama
from torch import nn

from hf_accel import Int4Linear, Int8Linear, WeightOnlyConfig, quantize_model
from hf_accel.bench.main_rows import compile_config
from hf_accel.kernels.custom_ops import quantized_linear_kernels
from hf_accel.quant import panels, weights

pytestmark = pytest.mark.skipif(quantized_linear_kernels() is None, reason="hf_accel's C++ extension is not built")
ROWS = (1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 40, 70)  # one pass, several passes over a panel, past format 0's kernel
FORMAT = panels.kernel_format() if quantized_linear_kernels() is not None else 0


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows the built kernel multiplies: format 1 quantizes each to int8 per 32 inputs (absmax / 127, round
    half to even), format 0 takes them as they are."""
    if FORMAT == 0:
        return x
    blocks = x.float().reshape(x.shape[0], -1, panels.BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(blocks / scale.clamp_min(1e-30)), 0).clamp(-127, 127)
    return (codes * scale).reshape(x.shape)


def weight(out_features=96, in_features=256, seed=0):
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


def relative_error(out, reference):
    return ((out.float() - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("fmt", [0, 1])
def test_panels_round_trip_exactly(fmt):
    codes8, _ = weights.quantize_int8(weight())
    codes4, qparams = weights.quantize_int4(weight(), 32)
    assert panels.pack_int8(codes8, fmt).shape == (6, 256, 16)
    assert panels.pack_int8(codes8, fmt).dtype == (torch.int8 if fmt == 0 else torch.uint8)
    assert torch.equal(panels.unpack_int8(panels.pack_int8(codes8, fmt), fmt), codes8)
    packed = panels.pack_int4(codes4, fmt)
    assert packed.shape == (6, 128, 16) and packed.dtype == torch.uint8
    if fmt == 0:  # byte j of a column: inputs 2j (low nibble) and 2j + 1 (high); column 3 of panel 0
        assert packed[0, 0, 3] == codes4[3, 0] | (codes4[3, 1] << 4)
    else:  # bytes 4c .. 4c + 3 of the first 64: column c's inputs 0..3 (low nibbles) and 4..7 (high)
        assert packed.flatten()[4 * 3 + 1] == codes4[3, 1] | (codes4[3, 5] << 4)
        assert int(panels.pack_int8(codes8, fmt).flatten()[4 * 3 + 2]) == int(codes8[3, 2]) + 128
    assert torch.equal(panels.unpack_int4(packed, fmt), codes4)
    qpanels = panels.pack_int4_params(qparams)
    assert qpanels.shape == (6, 8, 2, 16) and qpanels.dtype == torch.float16
    minimum = qparams[..., 1] - 8 * qparams[..., 0]  # [G, N]
    torch.testing.assert_close(qpanels[1, 2, 1, 5].float(), minimum[2, 21], rtol=1e-3, atol=1e-6)


def test_qparams_past_fp16_are_refused():
    _, qparams = weights.quantize_int4(weight() * 1e6, 32)
    assert panels.pack_int4_params(qparams) is None


@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_equals_the_dequantized_matmul(rows):
    int8_linear, _ = quantized_linear_kernels()
    codes, scale = weights.quantize_int8(weight())
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(96)
    dequantized = weights.dequantize_int8(codes, scale, torch.float32)
    out = int8_linear(x, panels.pack_int8(codes, FORMAT), scale, bias)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    assert relative_error(out, quantized_rows(x) @ dequantized.T + bias) < 1e-5
    assert relative_error(out, x @ dequantized.T + bias) < 2e-2  # format 1's activation rounding: about 1%


@pytest.mark.parametrize("group_size", [32, 64, 256])
@pytest.mark.parametrize("rows", (1, 3, 9, 70))
def test_grouped_int8_linear_equals_the_dequantized_matmul(rows, group_size):
    """int8 with one scale per group of inputs (GGUF's Q8_0 at group 32): scale panels `[P, G, 16]`."""
    int8_linear, _ = quantized_linear_kernels()
    codes, scale = weights.quantize_int8(weight(), group_size)
    assert scale.shape == (96, 256 // group_size)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    dequantized = weights.dequantize_int8(codes, scale, torch.float32)
    out = int8_linear(x, panels.pack_int8(codes, FORMAT), panels.pack_int8_scales(scale), None)
    assert relative_error(out, quantized_rows(x) @ dequantized.T) < 1e-5
    assert relative_error(out, x @ dequantized.T) < 2e-2


def test_one_group_of_int8_scales_is_the_per_channel_kernel_and_fp16_scales_are_fp32_ones_bit_for_bit():
    int8_linear, _ = quantized_linear_kernels()
    codes, scale = weights.quantize_int8(weight())
    x = torch.randn(5, 256)
    packed = panels.pack_int8(codes, FORMAT)
    fp32_panels = scale.view(6, 1, 16)
    assert torch.equal(int8_linear(x, packed, fp32_panels, None), int8_linear(x, packed, scale, None))
    grouped_codes, grouped = weights.quantize_int8(weight(), 32)
    scale_panels = panels.pack_int8_scales(grouped)  # fp16 (the stored scales are fp16 values): fp32 gives the same
    assert scale_panels.dtype == torch.float16
    assert torch.equal(int8_linear(x, panels.pack_int8(grouped_codes, FORMAT), scale_panels, None),
                       int8_linear(x, panels.pack_int8(grouped_codes, FORMAT), scale_panels.float(), None))
    assert panels.pack_int8_scales(grouped * 1e7).dtype == torch.float32  # past fp16 (65504): fp32 panels


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", ROWS)
def test_int4_linear_equals_the_dequantized_matmul(rows, group_size):
    _, int4_linear = quantized_linear_kernels()
    codes, qparams = weights.quantize_int4(weight(), group_size)
    qpanels = panels.pack_int4_params(qparams)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    # the kernel's (scale, minimum) are fp16: compare with the weight they give
    scale, minimum = qpanels.float().permute(1, 2, 0, 3).reshape(256 // group_size, 2, 96).unbind(1)
    dequantized = codes.float() * scale.t().repeat_interleave(group_size, 1) + minimum.t().repeat_interleave(
        group_size, 1)
    out = int4_linear(x, panels.pack_int4(codes, FORMAT), qpanels, None)
    assert relative_error(out, quantized_rows(x) @ dequantized.T) < 1e-5
    exact = x @ weights.dequantize_int4(codes, qparams, torch.float32).T  # fp16's and format 1's rounding are small
    assert relative_error(out, exact) < 2e-2


def symmetric_int4(group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes and qparams with every zero 0 (`w = (code - 8) * scale`, GGUF's Q4_0), scales fp16 values."""
    w = weight()
    groups = w.reshape(96, -1, group_size)
    scale = (groups.abs().amax(-1) / 8).half().float()  # [N, G]
    codes = (torch.round(groups / scale.unsqueeze(-1)) + 8).clamp(0, 15).to(torch.uint8).reshape(96, 256)
    return codes, torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1)  # qparams [G, N, 2]


def two_fields(qparams: torch.Tensor) -> torch.Tensor:
    """The (scale, minimum) qpanels of `qparams`, the layout `pack_int4_params` keeps for asymmetric groups."""
    scale, zero = qparams.float().unbind(-1)
    pairs = torch.stack([scale, zero - 8 * scale], dim=1).half()  # [G, 2, N]
    return pairs.reshape(pairs.shape[0], 2, -1, 16).permute(2, 0, 1, 3).contiguous()


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", (1, 3, 5, 9, 70))
def test_symmetric_int4_keeps_the_scale_alone_and_the_same_products(rows, group_size):
    """Zeros all 0: qpanels `[P, G, 1, 16]` (half the bytes), the kernel deriving minimum = -8 x scale: the same
    bits as the (scale, minimum) panels, equal to the dequantized matmul."""
    _, int4_linear = quantized_linear_kernels()
    codes, qparams = symmetric_int4(group_size)
    qpanels = panels.pack_int4_params(qparams)
    assert qpanels.shape == (6, 256 // group_size, 1, 16)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    packed = panels.pack_int4(codes, FORMAT)
    out = int4_linear(x, packed, qpanels, None)
    assert torch.equal(out, int4_linear(x, packed, two_fields(qparams), None))
    exact = weights.dequantize_int4(codes, qparams, torch.float32)
    assert relative_error(out, quantized_rows(x) @ exact.T) < 1e-5
    _, asymmetric = weights.quantize_int4(weight(), group_size)
    assert panels.pack_int4_params(asymmetric).shape[2] == 2


@pytest.mark.parametrize("bits", [8, 4])
def test_a_rows_result_does_not_depend_on_the_other_rows(bits):
    """What keeps a speculative verify (a few rows per sequence) on the tokens of plain decoding (one row)."""
    int8_linear, int4_linear = quantized_linear_kernels()
    codes8, scale = weights.quantize_int8(weight())
    codes4, qparams = weights.quantize_int4(weight(), 64)
    run = ((lambda x: int8_linear(x, panels.pack_int8(codes8, FORMAT), scale, None)) if bits == 8 else
           (lambda x: int4_linear(x, panels.pack_int4(codes4, FORMAT), panels.pack_int4_params(qparams), None)))
    x = torch.randn(11, 256)
    together = run(x)
    alone = torch.cat([run(x[i:i + 1]) for i in range(11)])
    if FORMAT == 1:
        assert torch.equal(together, alone)
    else:  # format 0 sums in another order at other row counts
        assert relative_error(together, alone) < 1e-5


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_rows_and_strided_rows(bits):
    int8_linear, int4_linear = quantized_linear_kernels()
    x = torch.randn(5, 512)[:, ::2]  # [5, 256], strided
    if bits == 8:
        codes, scale = weights.quantize_int8(weight())
        run = lambda rows: int8_linear(rows, panels.pack_int8(codes, FORMAT), scale, None)  # noqa: E731
    else:
        codes, qparams = weights.quantize_int4(weight(), 64)
        packed, qpanels = panels.pack_int4(codes, FORMAT), panels.pack_int4_params(qparams)
        run = lambda rows: int4_linear(rows, packed, qpanels, None)  # noqa: E731
    strided = run(x)
    assert torch.equal(strided, run(x.contiguous()))
    half = run(x.bfloat16())
    assert half.dtype == torch.bfloat16 and relative_error(half, strided) < 2e-2


@pytest.mark.parametrize("bits", [8, 4])
def test_threads_split_panels_without_changing_a_bit(bits):
    int8_linear, int4_linear = quantized_linear_kernels()
    codes8, scale = weights.quantize_int8(weight(512))
    codes4, qparams = weights.quantize_int4(weight(512), 32)
    x = torch.randn(3, 256)
    run = ((lambda: int8_linear(x, panels.pack_int8(codes8, FORMAT), scale, None)) if bits == 8 else
           (lambda: int4_linear(x, panels.pack_int4(codes4, FORMAT), panels.pack_int4_params(qparams), None)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        assert torch.equal(run(), one)
    finally:
        torch.set_num_threads(threads)


def test_bad_operands_are_refused():
    int8_linear, int4_linear = quantized_linear_kernels()
    codes, scale = weights.quantize_int8(weight())
    with pytest.raises(RuntimeError, match="disagree on K"):
        int8_linear(torch.randn(2, 128), panels.pack_int8(codes, FORMAT), scale, None)
    with pytest.raises(RuntimeError, match="scale must be"):
        int8_linear(torch.randn(2, 256), panels.pack_int8(codes, FORMAT), scale[:10], None)
    with pytest.raises(RuntimeError, match="multiple of 32"):  # groups of 16 inputs
        int8_linear(torch.randn(2, 256), panels.pack_int8(codes, FORMAT), torch.ones(6, 16, 16), None)
    with pytest.raises(RuntimeError, match=f"format {FORMAT}"):  # the other byte order's dtype
        int8_linear(torch.randn(2, 256), panels.pack_int8(codes, 1 - FORMAT), scale, None)
    codes4, qparams = weights.quantize_int4(weight(), 32)
    with pytest.raises(RuntimeError, match="qpanels"):
        int4_linear(torch.randn(2, 256), panels.pack_int4(codes4, FORMAT), panels.pack_int4_params(qparams).float(),
                    None)


@pytest.mark.parametrize("bits", [8, "8g32", 4])
def test_modules_use_the_panels_on_cpu_and_fall_back_where_they_do_not_fit(bits):
    torch.manual_seed(0)
    make = {8: lambda linear: Int8Linear.from_float(linear),
            "8g32": lambda linear: Int8Linear.from_float(linear, group_size=32),
            4: lambda linear: Int4Linear.from_float(linear, group_size=32)}[bits]
    fitting, odd = make(nn.Linear(64, 48)), make(nn.Linear(64, 40))  # 40 columns: not whole panels
    x = torch.randn(2, 7, 64)
    for module in (fitting, odd):
        reference = nn.functional.linear(x, module.dequantized_weight(), module.bias)
        torch.testing.assert_close(module(x), reference, rtol=2e-2, atol=2e-2)
    assert fitting.layout == "panels" and odd.layout != "panels"
    assert "weight_qpanels" not in fitting.state_dict() and "weight_scale_panels" not in fitting.state_dict()
    saved = fitting.state_dict()
    assert saved["weight"].shape == (48, 64 * fitting.bits // 32) and saved["weight"].dtype == torch.int32
    fresh = type(fitting)(64, 48, group_size=32) if bits != 8 else Int8Linear(64, 48)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh(x), fitting(x))


def test_int4_qparams_past_fp16_keep_torchs_kernel():
    module = Int4Linear.from_float(nn.Linear(64, 32), group_size=32)
    module.weight_qparams.data *= 1e6
    module(torch.randn(1, 64))
    assert module.layout == "cpu" and not module.qparams_fit_fp16


@pytest.mark.compiled
@pytest.mark.parametrize("bits, group_size", [(8, None), (8, 32), (4, 32)])
def test_quantized_models_generate_compiled_as_they_do_eagerly(bits, group_size):
    config = WeightOnlyConfig(bits=bits, group_size=group_size)
    model = quantize_model(tiny_llama(), config, progress=False)
    assert {module.layout for module in model.modules() if isinstance(module, (Int8Linear, Int4Linear))} == {"panels"}
    prompt = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(bits))
    options = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    eager = model.generate(prompt, **options)
    for cache in ("paged", "static"):  # hf_accel's compiled loop; transformers' own compiled loop
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        compiled = model.generate(prompt, cache_implementation=cache, compile_config=compile_config(stock=True),
                                  **options)
        assert torch.equal(compiled, eager), cache
        assert dynamo_utils.counters["stats"]["unique_graphs"] > graphs, f"{cache}: nothing was compiled"


FORMAT0_CHECK = """
import sys, torch
from torch.utils.cpp_extension import load
from hf_accel.kernels.build import CFLAGS, LDFLAGS, QUANTIZED_LINEAR_SOURCE
from hf_accel.quant import panels, weights
load(name="format0", sources=[str(QUANTIZED_LINEAR_SOURCE)], extra_cflags=CFLAGS + ["-DHF_ACCEL_QLINEAR_FORMAT0"],
     extra_ldflags=LDFLAGS, build_directory=sys.argv[1], is_python_module=False)
assert torch.ops.hf_accel.quantized_linear_format() == 0
w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
codes, scale = weights.quantize_int8(w)
codes4, qparams = weights.quantize_int4(w, 64)
codes_g, scale_g = weights.quantize_int8(w, 32)
qpanels = panels.pack_int4_params(qparams)
s, m = qpanels.float().permute(1, 2, 0, 3).reshape(4, 2, 96).unbind(1)
dequantized4 = codes4.float() * s.t().repeat_interleave(64, 1) + m.t().repeat_interleave(64, 1)
symmetric = torch.stack([qparams[..., 0].half().float(), torch.zeros_like(qparams[..., 0])], dim=-1)
qpanels_sym = panels.pack_int4_params(symmetric)  # the scale alone
qpanels_two = torch.cat([qpanels_sym, -8 * qpanels_sym], dim=2)  # (scale, minimum)
assert qpanels_sym.shape[2] == 1 and qpanels_two.shape[2] == 2
for rows in (1, 3, 9, 70):
    x = torch.randn(rows, 256)
    out8 = torch.ops.hf_accel.int8_linear(x, panels.pack_int8(codes, 0), scale, None)
    out4 = torch.ops.hf_accel.int4_linear(x, panels.pack_int4(codes4, 0), qpanels, None)
    out8g = torch.ops.hf_accel.int8_linear(x, panels.pack_int8(codes_g, 0), panels.pack_int8_scales(scale_g), None)
    sym4 = torch.ops.hf_accel.int4_linear(x, panels.pack_int4(codes4, 0), qpanels_sym, None)
    assert torch.equal(sym4, torch.ops.hf_accel.int4_linear(x, panels.pack_int4(codes4, 0), qpanels_two, None))
    for out, ref in ((out8, x @ weights.dequantize_int8(codes, scale, torch.float32).T), (out4, x @ dequantized4.T),
                     (out8g, x @ weights.dequantize_int8(codes_g, scale_g, torch.float32).T)):
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5, rows
print("format 0 ok")
"""


@pytest.mark.skipif(FORMAT != 1, reason="format 0 is the built kernel here: the tests above cover it")
def test_format_0_builds_and_computes_the_dequantized_matmul_too(tmp_path):
    """The byte order of CPUs without AVX-512 VNNI, built here with format 1 switched off (its own process: the ops'
    names are taken in this one)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORMAT0_CHECK, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "format 0 ok" in done.stdout, done.stderr[-3000:]
