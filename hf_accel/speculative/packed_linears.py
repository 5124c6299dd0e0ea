"""Eager speculative loops run their models' Linears over weights packed in column panels, for the length of a call.

Why: a speculative round's verify forward has a few rows per sequence (1 + k candidates), and at a few rows MKL's fp32
sgemm (what eager PyTorch runs) reads the weight once per handful of rows, far below the core's peak: on the reference
target (one thread of an AVX2 EPYC) a 5-token verify took 1.65x a one-token decode, where speculative decoding's
arithmetic assumes about 1x. `torch.ops.hf_accel.packed_linear` (`engine/csrc/packed_linear.cpp`, the kernel
hf_accel's compiled CPU steps use) streams each 16-column panel once for up to six rows: the same verify then takes
1.15x a decode.

`packed_linears(*modules)` packs every eligible `torch.nn.Linear` of the modules on entry (one more copy of those
weights while the call runs; 2-4 ms per million parameters to make on one core) and gives each an instance `forward`
over its panels; on exit, however the call ends, the forwards are removed and the panels freed. Nothing is kept
between calls, so a model trained or edited between calls is packed afresh. Eligible: exactly `nn.Linear` (not a
subclass or a quantized layer), fp32 weight on the CPU, no forward already replaced on the instance (accelerate's
hooks, another loop's panels), with gradients off. Results equal `F.linear` up to float rounding (another summation
order), as the compiled steps' do. Where the kernel cannot be built, or with `HF_ACCEL_PAGED_KERNEL=0`, nothing is
packed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..engine.packed_linears import pack_weight
from ..engine.paged_kernel import packed_linear_kernel


@contextlib.contextmanager
def packed_linears(*modules: nn.Module | None) -> Iterator[int]:
    """Within: the eligible Linears of `modules` (None entries skipped) compute over packed panels; yields how many."""
    kernel = packed_linear_kernel()
    linears = [] if kernel is None or torch.is_grad_enabled() else _eligible(modules)
    for linear in linears:
        weight = linear.weight.detach().t()  # [in, out]: the matmul's right operand as it lies
        linear.forward = functools.partial(_packed_forward, kernel, pack_weight(weight), weight, linear.bias)
    try:
        yield len(linears)
    finally:
        for linear in linears:
            linear.__dict__.pop("forward", None)


def _eligible(modules: tuple[nn.Module | None, ...]) -> list[nn.Linear]:
    """Each eligible Linear once (a module shared by two of `modules` is packed once)."""
    found: dict[int, nn.Linear] = {}
    for module in modules:
        if module is None:
            continue
        for sub in module.modules():
            if (type(sub) is nn.Linear and "forward" not in sub.__dict__ and sub.weight.dtype == torch.float32
                    and sub.weight.device.type == "cpu"):
                found.setdefault(id(sub), sub)
    return list(found.values())


def _packed_forward(kernel: Callable[..., torch.Tensor], panels: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, input: torch.Tensor) -> torch.Tensor:
    """`F.linear(input, weight.T, bias)` for `input` `[..., in]` over `panels` `[ceil(out / 16), in, 16]` ->
    `[..., out]` (named as `nn.Linear.forward` names it)."""
    out = kernel(input.reshape(-1, input.shape[-1]), panels, weight, bias)
    return out.view(*input.shape[:-1], out.shape[-1])
