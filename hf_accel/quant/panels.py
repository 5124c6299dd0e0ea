"""The panel layouts of hf_accel's quantized Linear kernels (`csrc/quantized_linear.cpp`): a weight's codes re-laid
once, 16 output columns per panel, so a decode streams each panel once for all its rows. The built kernel takes one
of two byte orders (`kernel_format()`; the .cpp file gives the arithmetic of each):

- format 0 (fp32 FMA): int8 codes `[N, K]` -> int8 `[N / 16, K, 16]` (panel p, row k: the k-th codes of columns
  16p .. 16p + 15); int4 codes -> uint8 `[N / 16, K / 2, 16]`, byte j of a column holding inputs 2j (low nibble) and
  2j + 1 (high).
- format 1 (integer dot products, AVX-512 VNNI): int8 -> uint8 code + 128, `[N / 16, K / 4, 16, 4]` (4 consecutive
  inputs per column) stored as `[N / 16, K, 16]`; int4 -> uint8 `[N / 16, K / 8, 16, 4]` stored as `[N / 16, K / 2,
  16]`, byte t of a column's 4 holding inputs 8i + t (low nibble) and 8i + 4 + t (high).
Both: the int4 qparams `[G, N, 2]` (scale, zero; `w = (code - 8) * scale + zero`) -> qpanels fp16 `[N / 16, G, 2,
16]` of (scale, minimum = zero - 8 * scale): `w = code * scale + minimum`, or `[N / 16, G, 1, 16]` of the scale alone
where every zero is 0 (the kernel takes minimum = -8 * scale); int8 keeps its per-column scale `[N]`,
and a grouped int8 scale `[N, G]` goes to fp16 `[N / 16, G, 16]` (fp32 past fp16's range).
Each packing has its inverse, so a module can give back its checkpoint format at any time.
"""

from __future__ import annotations

import functools

import torch

from .weights import INT4_OFFSET

PANEL = 16  # output columns per panel (the .cpp file's kPanel)
BLOCK = 32  # format 1: inputs per activation scale (the .cpp file's kXBlock)
HALF_MAX = torch.finfo(torch.float16).max


@functools.cache
def kernel_format() -> int:
    """The byte order the built kernels take (0 or 1); call only where the extension is built."""
    return int(torch.ops.hf_accel.quantized_linear_format())


def fits(out_features: int, in_features: int, fmt: int) -> bool:
    """Whether a weight `[out_features, in_features]` can be re-laid in panels of format `fmt`."""
    return out_features % PANEL == 0 and (fmt == 0 or in_features % BLOCK == 0)


def pack_int8(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    """int8 codes `[N, K]` -> panels `[N / 16, K, 16]` (int8 for format 0, uint8 for format 1)."""
    n, k = codes.shape
    columns = codes.reshape(n // PANEL, PANEL, k)
    if fmt == 0:
        return columns.transpose(1, 2).contiguous()
    shifted = (columns.to(torch.int16) + 128).to(torch.uint8)  # [P, 16, K]
    return shifted.reshape(n // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3).reshape(n // PANEL, k, PANEL).contiguous()


def unpack_int8(panels: torch.Tensor, fmt: int) -> torch.Tensor:
    """Inverse of `pack_int8`: int8 codes `[N, K]`."""
    count, k, _ = panels.shape
    if fmt == 0:
        return panels.transpose(1, 2).reshape(count * PANEL, k)
    quads = panels.reshape(count, k // 4, PANEL, 4).permute(0, 2, 1, 3).reshape(count * PANEL, k)
    return (quads.to(torch.int16) - 128).to(torch.int8)


def pack_int4(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    """uint8 codes `[N, K]` (0..15) -> panels uint8 `[N / 16, K / 2, 16]`, two codes a byte."""
    n, k = codes.shape
    if fmt == 0:
        columns = codes.reshape(n // PANEL, PANEL, k).transpose(1, 2)  # [P, K, 16]
        return (columns[:, 0::2] | (columns[:, 1::2] << 4)).contiguous()
    eights = codes.reshape(n // PANEL, PANEL, k // 8, 2, 4)  # input 8i + 4h + t
    packed = eights[..., 0, :] | (eights[..., 1, :] << 4)  # [P, 16, K / 8, 4]
    return packed.permute(0, 2, 1, 3).reshape(n // PANEL, k // 2, PANEL).contiguous()


def unpack_int4(panels: torch.Tensor, fmt: int) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 codes `[N, K]`."""
    count, pairs, _ = panels.shape
    if fmt == 0:
        columns = torch.stack([panels & 15, panels >> 4], dim=2).reshape(count, pairs * 2, PANEL)
        return columns.transpose(1, 2).reshape(count * PANEL, pairs * 2)
    quads = panels.reshape(count, pairs // 4, PANEL, 4).permute(0, 2, 1, 3)  # [P, 16, K / 8, 4]
    eights = torch.stack([quads & 15, quads >> 4], dim=3)  # [P, 16, K / 8, 2, 4]
    return eights.reshape(count * PANEL, pairs * 2)


def pack_int4_params(qparams: torch.Tensor) -> torch.Tensor | None:
    """qparams `[G, N, 2]` (scale, zero) -> qpanels fp16 `[N / 16, G, 2, 16]` (scale, minimum), or `[N / 16, G, 1,
    16]` (the scale alone) where every fp16 minimum is exactly -8 x its fp16 scale (zero 0: symmetric, as GGUF's Q4_0
    is), which the kernel then derives: the same products from half the bytes. None where a value does not fit fp16
    (the module then keeps another kernel)."""
    scale, zero = qparams.float().unbind(-1)  # [G, N]
    pairs = torch.stack([scale, zero - INT4_OFFSET * scale], dim=1)  # [G, 2, N]
    if not pairs.isfinite().all() or pairs.abs().max() > HALF_MAX:
        return None
    halves = pairs.to(torch.float16)
    if torch.equal(halves[:, 1].float(), -INT4_OFFSET * halves[:, 0].float()):
        halves = halves[:, :1]
    groups, fields, n = halves.shape
    return halves.reshape(groups, fields, n // PANEL, PANEL).permute(2, 0, 1, 3).contiguous()


def pack_int8_scales(scale: torch.Tensor) -> torch.Tensor:
    """A grouped int8 scale `[N, G]` -> scale panels `[N / 16, G, 16]` (the kernel's per-group operand): fp16, as
    GGUF's Q8_0 stores them (exact for its scales; 1 / 16 of the codes' bytes at groups of 32), or fp32 where a
    value does not fit fp16."""
    n, groups = scale.shape
    panels = scale.float().reshape(n // PANEL, PANEL, groups).transpose(1, 2).contiguous()
    fits = panels.isfinite().all() and panels.abs().max() <= HALF_MAX
    return panels.to(torch.float16) if fits else panels
