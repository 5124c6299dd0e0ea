"""Linears over weights packed in column panels (`torch.ops.hf_accel.packed_linear`, `csrc/packed_linear.cpp`): the
panel layout (`pack_weight`) and the graph pass that puts the op into compiled CPU steps.

hf_accel compiles its steps with frozen weights (`runtime.frozen_graphs.step_graph_settings`): each Linear's weight
is a constant of the graph. Where `settings()` is applied, a post-grad pass (`PackLinears`, inductor's custom-pass seam)
rewrites every fp32 matmul whose right operand is such a constant, `mm(x, W)` or `addmm(b, x, W)`, into
`packed_linear(x, pack_weight(W), W, b)`; the panels are computed once, when the graph is compiled, and kept as a new
constant of the graph (as oneDNN's packed copy was, which those graphs no longer make: `cpp.weight_prepack` off). The
model itself is not changed: its own forward still runs `torch.nn.functional.linear` (eager callers run the same op
for the length of a call: `eager_packing.py`).

Why: at the few rows of a decode, a speculative verify or a small batch, oneDNN's and MKL's fp32 matmuls read the
weight once per handful of rows and run far below the core's peak; the kernel streams each panel once for up to six
rows (twelve with AVX-512; see the .cpp file; benchmarks/bench_linear.py measures both). Past `kPackedRows` rows (128;
48 with AVX-512) the op runs ATen's matmul over `W`. Results equal `x @ W` up to float rounding (another summation
order). Without AVX2 and FMA, or where the kernel cannot be built, the op is ATen's matmul (the settings are then not
applied).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .build import PACKED_LINEAR_SOURCE
from .custom_ops import packed_linear_kernel

PANEL = 16  # columns per panel (csrc/packed_linear.cpp's kPanel)
# gives the fingerprint of the weights the graph compiled now freezes (`runtime.frozen_graphs`), or None
FROZEN_WEIGHTS: contextvars.ContextVar[Callable[[], str | None] | None] = contextvars.ContextVar(
    "hf_accel_frozen_weights", default=None)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A matmul's right operand `[K, N]` (any strides) -> its panels `[ceil(N / 16), K, 16]`: panel p holds columns
    16p .. 16p + 15, row k their k-th inputs, zeros past N."""
    k, n = weight.shape
    panels = -(-n // PANEL)
    columns = weight.t()  # [N, K]: a Linear's own weight, contiguous, so the panels take one transposing copy
    if n % PANEL:  # (and the padded copy, where N is not a multiple of 16)
        columns = torch.cat([columns, columns.new_zeros(panels * PANEL - n, k)])
    return columns.reshape(panels, PANEL, k).transpose(1, 2).contiguous()


class PackLinears(CustomGraphPass):
    """Post-grad pass: fp32 `mm` / `addmm` (alpha = beta = 1, a `[N]` bias) of a CPU graph whose right operand is a
    frozen constant -> `hf_accel::packed_linear` over that constant's panels (each one counted in dynamo's
    `counters["hf_accel"]["packed_linears"]`).

    Inductor's FX graph cache keys a graph's frozen weights by shape alone and keeps the constants a pass adds (the
    panels) in its entry, so an entry is correct only for the weights it was packed from. `uuid`, part of the key,
    therefore carries the fingerprint of the weights the graph being compiled freezes, which `FROZEN_WEIGHTS` gives
    (set around each call of a compiled function by `runtime.frozen_graphs`, computed at the first compile that
    asks); where there is none `uuid` is None and inductor bypasses its cache for that graph.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        for node in list(graph.nodes):
            operands = _linear_operands(node, module)
            if operands is None:
                continue
            x, weight, bias = operands
            name = _free_name(module)
            module.register_buffer(name, pack_weight(getattr(module, weight.target)))
            with graph.inserting_before(node):
                panels = graph.get_attr(name)
                panels.meta["val"] = x.meta["val"].fake_mode.from_tensor(getattr(module, name))
                linear = graph.call_function(torch.ops.hf_accel.packed_linear.default, (x, panels, weight, bias))
            linear.meta.update(node.meta)
            node.replace_all_uses_with(linear)
            graph.erase_node(node)
            counters["hf_accel"]["packed_linears"] += 1

    def uuid(self) -> bytes | None:
        fingerprint = FROZEN_WEIGHTS.get()
        weights = None if fingerprint is None else fingerprint()
        if weights is None:
            return None
        return get_hash_for_files((__file__, str(PACKED_LINEAR_SOURCE))) + weights.encode()


def settings(enabled: bool) -> dict:
    """Inductor settings for the graphs compiled under them (with freezing): their fp32 Linears over packed panels,
    when `enabled` and the kernel is built; else none."""
    if not enabled or packed_linear_kernel() is None:
        return {}
    # inductor's FX graph cache keeps such graphs only under a fingerprint of their weights (`PackLinears.uuid`)
    return {"cpp.weight_prepack": False, "post_grad_custom_post_pass": PackLinears()}


def _linear_operands(node: torch.fx.Node, module: torch.nn.Module):
    """(x, weight, bias) of a matmul the pass rewrites, else None."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.aten.mm.default and not node.kwargs:
        (x, weight), bias = node.args, None
    elif node.target is torch.ops.aten.addmm.default and not node.kwargs:
        bias, x, weight = node.args
    else:
        return None
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr" or not isinstance(x, torch.fx.Node):
        return None
    tensor = getattr(module, weight.target, None)
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        return None
    value = x.meta.get("val")
    if value is None or value.dtype != torch.float32 or tensor.dim() != 2:
        return None
    if bias is not None:
        shape = bias.meta["val"].shape if isinstance(bias, torch.fx.Node) and "val" in bias.meta else None
        if shape is None or tuple(shape) != (tensor.shape[1],) or bias.meta["val"].dtype != torch.float32:
            return None
    return x, weight, bias


def _free_name(module: torch.nn.Module) -> str:
    index = 0
    while hasattr(module, f"_hf_accel_panels_{index}"):
        index += 1
    return f"_hf_accel_panels_{index}"
