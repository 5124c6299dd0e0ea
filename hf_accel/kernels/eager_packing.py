"""Eager callers run their models' Linears over weights packed in column panels, for the length of a call.

Why: a speculative round's verify forward has a few rows per sequence (1 + k candidates), and at a few rows MKL's fp32
sgemm (what eager PyTorch runs) reads the weight once per handful of rows, far below the core's peak, where
speculative decoding's arithmetic assumes a verify costs about one decode. `torch.ops.hf_accel.packed_linear`
(`csrc/packed_linear.cpp`, the kernel hf_accel's compiled CPU steps use) streams each 16-column panel once for up to
six rows (docs/speculative.md has the measured costs).

`packed_linears(*modules)` packs every eligible `torch.nn.Linear` of the modules on entry (`linear_panels.eligible`;
one more copy of those weights while the call runs) and gives each an instance `forward` over its panels
(`registry.instance_forwards`); on exit, however the call ends, the forwards it set are removed and the panels freed.
Nothing is kept between calls, so a model trained or edited between calls is packed afresh. Nothing is packed where
the panels would take more than half the memory available (a warning says so), with gradients or CPU autocast on,
without the kernel (not buildable, `HF_ACCEL_PAGED_KERNEL=0`) or with `HF_ACCEL_PACKED_LINEARS=0`. Results equal
`F.linear` up to float rounding (another summation order), as the compiled steps' do.

Why instance forwards: no transformers or torch seam swaps a Linear's matmul for the length of a call without a
per-op cost (a `TorchFunctionMode` intercepting `F.linear` sees every torch call of the forward and gave back most
of the gain), and a copy of the model would double its memory for good. A model serving from another thread
meanwhile (the Engine compiling it) would trace them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import psutil
import torch
from torch import nn

from ..registry import instance_forwards
from .custom_ops import packed_linear_kernel
from .linear_panels import eligible, packed_forward

ENV_SWITCH = "HF_ACCEL_PACKED_LINEARS"  # "0": eager loops keep MKL's matmuls
MEMORY_SHARE = 0.5  # the most of the available memory the panels may take


@contextlib.contextmanager
def packed_linears(*modules: nn.Module | None) -> Iterator[int]:
    """Within: the eligible Linears of `modules` (None entries skipped) compute over packed panels; yields how many."""
    kernel = packed_linear_kernel()
    off = (kernel is None or os.environ.get(ENV_SWITCH) == "0" or torch.is_grad_enabled()
           or torch.is_autocast_enabled("cpu"))
    linears = [] if off else _fitting(eligible(modules))
    # packed inside `instance_forwards`: a failure part-way (out of memory) still restores the forwards already set
    with instance_forwards((linear, packed_forward(kernel, linear)) for linear in linears) as count:
        yield count


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
