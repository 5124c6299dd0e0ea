"""Pure tensor functions for group-wise asymmetric integer quantization with bit packing.

A tensor is split into groups of `group_size` consecutive elements along one axis; each group gets a scale and a
minimum (the zero point) in the input's dtype, and every element becomes an unsigned `nbits` code:

    code = clamp(round((x - min) / scale), 0, 2**nbits - 1)        x ~= code * scale + min

Codes are packed along the LAST axis in bit planes: with `k = 8 // nbits` codes per byte, byte `j` of a row holds
codes `j, j + D/k, ..., j + (k-1) D/k`, the first in the lowest bits. A `[..., D]` tensor of codes is stored as
`[..., D // k]` uint8, so memory really shrinks for 4 and 2 bits, and unpacking is `k` shift-and-mask passes over
contiguous bytes (no interleaving), which keeps dequantization close to a plain copy on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_NBITS = (2, 4, 8)


@dataclass(slots=True)
class QuantizedTensor:
    """Packed codes with per-group scale and minimum.

    `codes`: uint8 `[..., n, D * nbits // 8]`; `scale`, `minimum`: the input dtype, with the quantized axis reduced
    to groups (`[..., n // G, 1, D]` when grouping the second-to-last axis, `[..., n, D // G, 1]` the last).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    nbits: int
    group_size: int
    axis: int  # -2: groups run along the second-to-last axis (per channel), -1: along the last (per token)

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[-2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum))

    def map_tensors(self, fn) -> QuantizedTensor:
        """The same quantized data with `fn` applied to codes, scale and minimum (e.g. a row selection)."""
        return QuantizedTensor(fn(self.codes), fn(self.scale), fn(self.minimum), self.nbits, self.group_size, self.axis)


def quantize(x: torch.Tensor, nbits: int, group_size: int, axis: int) -> QuantizedTensor:
    """Quantize `x` `[..., n, D]` in groups of `group_size` along `axis` (-2: per channel, -1: per token).

    Scale and minimum are stored in `x.dtype`; codes are computed in fp32 from those stored values, so dequantizing
    reproduces each element to within half a step of its group.
    """
    grouped = _grouped(x.float(), group_size, axis)
    minimum = grouped.amin(dim=axis, keepdim=True)  # the group axis of `_grouped` sits at `axis` again
    levels = (1 << nbits) - 1
    # a constant group has range 0: any positive scale reproduces it exactly (all codes 0)
    scale = ((grouped.amax(dim=axis, keepdim=True) - minimum) / levels).clamp_min(torch.finfo(x.dtype).tiny)
    scale, minimum = scale.to(x.dtype), minimum.to(x.dtype)
    codes = ((grouped - minimum.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return QuantizedTensor(pack(codes.reshape(x.shape), nbits), scale, minimum, nbits, group_size, axis)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`codes * scale + minimum` as `[..., n, D]` in the scale's dtype, written into `out` when given."""
    codes = unpack(q.codes, q.nbits)
    if out is None:
        out = torch.empty(codes.shape, dtype=q.scale.dtype, device=codes.device)
    out.copy_(codes)  # one conversion pass, then in-place affine: faster on CPU than a type-promoting addcmul
    _grouped(out, q.group_size, q.axis).mul_(q.scale).add_(q.minimum)
    return out


def concat(first: QuantizedTensor, second: QuantizedTensor) -> QuantizedTensor:
    """`first` followed by `second` along the token axis (both quantized with the same settings)."""
    # codes: tokens on dim -2; scale/minimum: tokens (or token groups) on dim -3 for both axes
    return QuantizedTensor(
        torch.cat((first.codes, second.codes), dim=-2),
        torch.cat((first.scale, second.scale), dim=-3),
        torch.cat((first.minimum, second.minimum), dim=-3),
        first.nbits,
        first.group_size,
        first.axis,
    )


def pack(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """uint8 codes `[..., D]` (each < 2**nbits, `D` a multiple of `8 // nbits`) -> `[..., D * nbits // 8]` bytes."""
    if nbits == 8:
        return codes
    planes = codes.reshape(*codes.shape[:-1], 8 // nbits, -1)  # [..., k, D/k]
    packed = planes[..., 0, :].clone()
    for i in range(1, 8 // nbits):
        packed |= planes[..., i, :] << (i * nbits)
    return packed


def unpack(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of `pack`: `[..., B]` bytes -> `[..., B * 8 // nbits]` uint8 codes."""
    if nbits == 8:
        return packed
    mask = (1 << nbits) - 1
    planes = [packed & mask] + [(packed >> (i * nbits)) & mask for i in range(1, 8 // nbits)]
    return torch.cat(planes, dim=-1)


def _grouped(x: torch.Tensor, group_size: int, axis: int) -> torch.Tensor:
    # axis -2: [..., n, D] -> [..., n // G, G, D];  axis -1: [..., n, D] -> [..., n, D // G, G]
    if axis == -2:
        return x.view(*x.shape[:-2], x.shape[-2] // group_size, group_size, x.shape[-1])
    return x.view(*x.shape[:-1], x.shape[-1] // group_size, group_size)
