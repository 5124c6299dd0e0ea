"""Eager callers run their models' Linears over weights packed in column panels, for the length of a call.

Why: a speculative round's verify forward has a few rows per sequence (1 + k candidates), and at a few rows MKL's fp32
sgemm (what eager PyTorch runs) reads the weight once per handful of rows, far below the core's peak, where
speculative decoding's arithmetic assumes a verify costs about one decode. `torch.ops.hf_accel.packed_linear`
(`csrc/packed_linear.cpp`, the kernel hf_accel's compiled CPU steps use) streams each 16-column panel once for up to
six rows (docs/speculative.md has the measured costs).

`packed_linears(*modules)` packs every eligible `torch.nn.Linear` of the modules on entry (one more copy of those
weights while the call runs) and gives each an instance `forward` over its panels (`registry.instance_forwards`, the
one place hf_accel replaces a forward); on exit, however the call ends, the forwards it set are removed and the panels
freed. Nothing is kept between calls, so a model trained or edited between calls is packed afresh. Eligible: exactly
`nn.Linear` (not a subclass or a quantized layer) whose weight is a plain fp32 CPU tensor (not a tensor subclass, as
torchao's quantized weights are), no forward already replaced on the instance (accelerate's hooks, another loop's
panels). Nothing is packed where the panels would take more than half the memory available (a warning says so), with
gradients or CPU autocast on, in a module tree holding a compiled module (`module.compile()`, a compiled `forward`:
dynamo would trace the replaced forwards and recompile on every call), without the kernel (not buildable,
`HF_ACCEL_PAGED_KERNEL=0`) or with `HF_ACCEL_PACKED_LINEARS=0`. Results equal `F.linear` up to float rounding
(another summation order), as the compiled steps' do.

Why instance forwards: no transformers or torch seam swaps a Linear's matmul for the length of a call without a
per-op cost (a `TorchFunctionMode` intercepting `F.linear` sees every torch call of the forward and gave back most
of the gain), and a copy of the model would double its memory for good. A model serving from another thread
meanwhile (the Engine compiling it) would trace them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator

import psutil
import torch
from torch import nn

from ..registry import instance_forwards
from .custom_ops import packed_linear_kernel
from .packed_linear import pack_weight

ENV_SWITCH = "HF_ACCEL_PACKED_LINEARS"  # "0": eager loops keep MKL's matmuls
MEMORY_SHARE = 0.5  # the most of the available memory the panels may take


@contextlib.contextmanager
def packed_linears(*modules: nn.Module | None) -> Iterator[int]:
    """Within: the eligible Linears of `modules` (None entries skipped) compute over packed panels; yields how many."""
    kernel = packed_linear_kernel()
    off = (kernel is None or os.environ.get(ENV_SWITCH) == "0" or torch.is_grad_enabled()
           or torch.is_autocast_enabled("cpu"))
    linears = [] if off else _fitting(_eligible(modules))
    # packed inside `instance_forwards`: a failure part-way (out of memory) still restores the forwards already set
    with instance_forwards((linear, _packed_forward(kernel, linear)) for linear in linears) as count:
        yield count


def _eligible(modules: tuple[nn.Module | None, ...]) -> list[nn.Linear]:
    """Each eligible Linear once (a module shared by two of `modules` is packed once); none under a compiled tree."""
    found: dict[int, nn.Linear] = {}
    for module in modules:
        if module is None or _compiled(module):
            continue
        for sub in module.modules():
            if type(sub) is nn.Linear and "forward" not in sub.__dict__ and _plain_fp32_cpu(sub.weight):
                found.setdefault(id(sub), sub)
    return list(found.values())


def _plain_fp32_cpu(weight: torch.Tensor) -> bool:
    """A plain tensor (not a subclass with its own matmul, as torchao's quantized weights are), fp32, on the CPU."""
    return type(weight.data) is torch.Tensor and weight.dtype == torch.float32 and weight.device.type == "cpu"


def _fitting(linears: list[nn.Linear]) -> list[nn.Linear]:
    """`linears`, or none (with a warning) where their panels would take more than `MEMORY_SHARE` of the memory
    available now: a large fp32 model must not run out of memory to go faster."""
    needed = sum(linear.weight.numel() * 4 for linear in linears)  # bytes, fp32 (the padding aside)
    available = psutil.virtual_memory().available
    if needed <= MEMORY_SHARE * available:
        return linears
    warnings.warn(f"hf_accel: the eager loop's Linears keep MKL's matmuls: packing them would take "
                  f"{needed / 2**30:.1f} GiB of the {available / 2**30:.1f} GiB available "
                  f"({ENV_SWITCH}=0 turns packing off, and this warning)", stacklevel=4)
    return []


def _compiled(module: nn.Module) -> bool:
    """Whether any module of the tree is compiled (`nn.Module.compile`) or has a replaced non-Linear forward (a
    `torch.compile`d `forward`, a wrapper): its graphs would trace the packed forwards."""
    return any(getattr(sub, "_compiled_call_impl", None) is not None
               or ("forward" in sub.__dict__ and type(sub) is not nn.Linear) for sub in module.modules())


def _packed_forward(kernel: Callable[..., torch.Tensor], linear: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear`'s forward over its weight's panels (packed now)."""
    weight = linear.weight.detach().t()  # [in, out]: the matmul's right operand as it lies
    return functools.partial(_panels_forward, kernel, pack_weight(weight), weight, linear.bias)


def _panels_forward(kernel: Callable[..., torch.Tensor], panels: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, input: torch.Tensor) -> torch.Tensor:
    """`F.linear(input, weight.T, bias)` for `input` `[..., in]` over `panels` `[ceil(out / 16), in, 16]` ->
    `[..., out]` (named as `nn.Linear.forward` names it)."""
    out = kernel(input.reshape(-1, input.shape[-1]), panels, weight, bias)
    return out.view(*input.shape[:-1], out.shape[-1])
