"""The packed Linear of the compiled CPU steps: `torch.ops.hf_accel.packed_linear` against ATen's matmul at every row
count the kernel's blocking has a case for (and past its row limit, where it calls a GEMM: oneDNN's on an AMD CPU from
a size on, MKL's otherwise), odd sizes, biases and strided inputs; the panel layout exact on a small weight; the post-grad pass rewriting exactly the frozen fp32
Linears of a compiled graph (not bf16 ones, nothing without the setting) with the module's results."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from hf_accel.bench.timing import torch_threads
from hf_accel.runtime.frozen_graphs import step_graph_settings
from hf_accel.kernels.packed_linear import pack_weight
from hf_accel.kernels.custom_ops import packed_linear_kernel

kernel = packed_linear_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the hf_accel kernels could not be built here")

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 24, 25, 48, 49, 128, 129, 300)  # passes of 6 (12); ATen past 128 (48)


def test_panels_hold_sixteen_columns_each_and_zeros_past_the_last():
    weight = torch.arange(3 * 20, dtype=torch.float32).view(3, 20)  # [K, N]
    panels = pack_weight(weight)
    assert panels.shape == (2, 3, 16) and panels.is_contiguous()
    assert torch.equal(panels[0], weight[:, :16])
    assert torch.equal(panels[1, :, :4], weight[:, 16:]) and not panels[1, :, 4:].any()
    assert torch.equal(pack_weight(weight.t().contiguous().t()), panels)  # any strides


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k,n", [(256, 768), (64, 50), (7, 3), (33, 16), (300, 17)])
def test_the_op_equals_atens_matmul(rows, k, n):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    weight = torch.randn(n, k, generator=gen).t()  # a Linear's weight as the matmul reads it: [K, N], strided
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    panels = pack_weight(weight)
    torch.testing.assert_close(kernel(x, panels, weight, bias), torch.addmm(bias, x, weight), rtol=1e-4, atol=1e-4)
    strided = torch.randn(k, rows, generator=gen).t()
    torch.testing.assert_close(kernel(strided, panels, weight, None), strided @ weight, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows, k, n", [(49, 64, 128), (200, 256, 768), (880, 768, 3072)])
def test_many_rows_take_a_gemm_that_equals_the_linear(rows, k, n):
    """Past the panels' rows: below and above the size from which an AMD CPU takes oneDNN's GEMM, a contiguous Linear
    weight (which oneDNN reads) and a strided one (MKL's), contiguous and strided rows, with and without a bias."""
    gen = torch.Generator().manual_seed(rows + k + n)
    linear = torch.randn(n, k, generator=gen)
    strided = torch.randn(k, n, generator=gen).t()  # [N, K], not contiguous
    bias, x = torch.randn(n, generator=gen), torch.randn(rows, k, generator=gen)
    for weight in (linear, strided):
        flat = pack_weight(weight.t()).flatten()  # (read where the panels take these rows: AVX2 takes 128)
        for inputs in (x, x.t().contiguous().t()):
            for b in (bias, None):
                expected = torch.nn.functional.linear(inputs, weight, b)
                torch.testing.assert_close(torch.ops.hf_accel.panel_linear(inputs, flat, 0, weight, b), expected,
                                           rtol=1e-4, atol=1e-3)
                torch.testing.assert_close(kernel(inputs, flat.view(-1, k, 16), weight.t(), b), expected,
                                           rtol=1e-4, atol=1e-3)


def test_bad_shapes_are_refused():
    weight = torch.randn(8, 20)
    panels = pack_weight(weight)
    with pytest.raises(RuntimeError, match="disagree on K"):
        kernel(torch.randn(2, 9), panels, weight, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel(torch.randn(2, 8), panels, weight, torch.randn(19))
    with pytest.raises(RuntimeError, match="packed must be"):
        kernel(torch.randn(2, 8), panels[:1], weight, None)


def test_the_op_and_its_fake_agree():
    weight = torch.randn(24, 40)
    torch.library.opcheck(torch.ops.hf_accel.packed_linear.default,
                          (torch.randn(5, 24), pack_weight(weight), weight, torch.randn(40)))
    flat = torch.cat([torch.zeros(16), pack_weight(weight).flatten()])
    torch.library.opcheck(torch.ops.hf_accel.panel_linear.default,
                          (torch.randn(5, 24), flat, 16, weight.t().contiguous(), torch.randn(40)))


@pytest.mark.parametrize("rows", (1, 6, 12, 13, 300))
def test_panel_linear_reads_its_panels_at_their_offset_of_a_shared_buffer(rows):
    gen = torch.Generator().manual_seed(rows)
    first, second = torch.randn(20, 8, generator=gen), torch.randn(50, 33, generator=gen)  # Linears' [N, K]
    flat = torch.cat([pack_weight(first.t()).flatten(), pack_weight(second.t()).flatten()])
    start = pack_weight(first.t()).numel()
    x, bias = torch.randn(rows, 33, generator=gen), torch.randn(50, generator=gen)
    out = torch.ops.hf_accel.panel_linear(x, flat, start, second, bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, second, bias), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="run past the buffer"):
        torch.ops.hf_accel.panel_linear(x, flat, start + 16, second, None)
    with pytest.raises(RuntimeError, match="disagree on K"):
        torch.ops.hf_accel.panel_linear(x[:, :8], flat, 0, second, None)


def mlp(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.SiLU(), torch.nn.Linear(80, 24, bias=False)).to(dtype)


def compiled_rewrites(module: torch.nn.Module, dtype: torch.dtype | None, inputs: list[torch.Tensor]) -> int:
    """Run `module` compiled (frozen for a model of `dtype`, dynamic) on each input, checking it against the module;
    -> matmuls rewritten."""
    before = counters["hf_accel"]["packed_linears"]
    compiled = torch.compile(module, dynamic=True, fullgraph=True)
    tolerance = 1e-5 if next(module.parameters()).dtype == torch.float32 else 3e-2
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False), \
            step_graph_settings(True, dtype):
        for x in inputs:
            torch.testing.assert_close(compiled(x), module(x), rtol=tolerance, atol=tolerance)
    return counters["hf_accel"]["packed_linears"] - before


def test_the_pass_rewrites_each_frozen_fp32_linear_once_for_every_row_count():
    torch._dynamo.reset()
    inputs = [torch.randn(1, rows, 48) for rows in (3, 5, 9, 200)]  # one dynamic graph for all of them
    assert compiled_rewrites(mlp(torch.float32), torch.float32, inputs) == 2


def test_the_pass_leaves_bf16_linears_and_runs_only_when_asked():
    torch._dynamo.reset()
    assert compiled_rewrites(mlp(torch.bfloat16), torch.float32, [torch.randn(1, 4, 48, dtype=torch.bfloat16)]) == 0
    torch._dynamo.reset()
    assert compiled_rewrites(mlp(torch.float32), None, [torch.randn(1, 4, 48)]) == 0


def test_step_graphs_run_their_own_kernels_on_one_thread_without_per_call_asserts():
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * x + 1

    x = torch.randn(64, 4096)
    with torch_threads(2), torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        _, (plain,) = run_and_get_code(torch.compile(step, fullgraph=True), x)
        torch._dynamo.reset()
        with step_graph_settings(False):
            _, (ours,) = run_and_get_code(torch.compile(step, fullgraph=True), x)
    assert "#pragma omp parallel" in plain and "assert_size_stride(" in plain  # what the settings take away
    assert "#pragma omp parallel" not in ours and "assert_size_stride(" not in ours and "assert_alignment(" not in ours
