"""`argmax_rows`: the greedy choice over logits on the host, through numpy where it applies.

torch's CPU argmax reduces a row without vectorising it (torch 2.13, AVX-512 build, one thread): ~75 us for one row
of 32k logits and ~4 ms for 64 rows, where numpy's takes ~6 us and ~0.35 ms. Every greedy step of the Engine and
of hf_accel's host decoding loops takes an argmax over `[rows, vocab]` logits, so at a real vocabulary and batch the
reduction cost more than the mask or the sampler around it. Both return each row's first maximum, NaN counting as
the maximum, so the choice is the same token. Graphs (dynamo tracing), other devices and dtypes numpy lacks keep
torch's (so do traces, subclasses and views numpy cannot read).
"""

from __future__ import annotations

import numpy
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)  # numpy reduces these with SIMD (not float16)


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """`scores` `[..., vocab]` -> `[...]` int64: the index of each row's first maximum (as `scores.argmax(-1)`)."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()  # first: dynamo cannot trace the checks below
            or type(scores) is not torch.Tensor or scores.device.type != "cpu" or scores.dtype not in _NUMPY_DTYPES
            or scores.requires_grad or scores.numel() == 0 or scores.is_neg() or scores.is_conj()):
        return scores.argmax(dim=-1)
    return torch.from_numpy(numpy.asarray(scores.numpy().argmax(axis=-1), dtype=numpy.int64))
