"""The panel layout of hf_accel's quantized Linear kernels (`csrc/quantized_linear.cpp`): a weight's codes re-laid
once, 16 output columns per panel, so a decode streams each panel once for all its rows.

- int8: codes `[N, K]` -> panels int8 `[N / 16, K, 16]` (panel p, row k: the k-th codes of columns 16p .. 16p + 15);
  the per-column scale stays `[N]`.
- int4: codes `[N, K]` (0..15) -> panels uint8 `[N / 16, K / 2, 16]` (byte j of a column: code 2j in the low nibble,
  2j + 1 in the high), and qparams `[G, N, 2]` (scale, zero; `w = (code - 8) * scale + zero`) -> qpanels fp16
  `[N / 16, G, 2, 16]` of (scale, minimum = zero - 8 * scale): `w = code * scale + minimum`.
Each function here has its inverse, so a module can give back its checkpoint format at any time. `N` must be a
multiple of 16 (`fits`).
"""

from __future__ import annotations

import torch

from .weights import INT4_OFFSET

PANEL = 16  # output columns per panel (the .cpp file's kPanel)
HALF_MAX = torch.finfo(torch.float16).max


def fits(out_features: int) -> bool:
    """Whether a weight with `out_features` columns can be re-laid in panels."""
    return out_features % PANEL == 0


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes `[N, K]` -> panels `[N / 16, K, 16]`."""
    n, k = codes.shape
    return codes.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack_int8(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int8`: codes `[N, K]`."""
    count, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(count * PANEL, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[N, K]` (0..15) -> panels `[N / 16, K / 2, 16]`, two codes a byte."""
    columns = pack_int8(codes)  # [P, K, 16]
    return (columns[:, 0::2] | (columns[:, 1::2] << 4)).contiguous()


def unpack_int4(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 codes `[N, K]`."""
    count, pairs, _ = panels.shape
    columns = torch.stack([panels & 15, panels >> 4], dim=2).reshape(count, pairs * 2, PANEL)
    return unpack_int8(columns)


def pack_int4_params(qparams: torch.Tensor) -> torch.Tensor | None:
    """qparams `[G, N, 2]` (scale, zero) -> qpanels fp16 `[N / 16, G, 2, 16]` (scale, minimum); None where a value
    does not fit fp16 (the module then keeps another kernel)."""
    scale, zero = qparams.float().unbind(-1)  # [G, N]
    pairs = torch.stack([scale, zero - INT4_OFFSET * scale], dim=1)  # [G, 2, N]
    if not pairs.isfinite().all() or pairs.abs().max() > HALF_MAX:
        return None
    groups, _, n = pairs.shape
    return pairs.reshape(groups, 2, n // PANEL, PANEL).permute(2, 0, 1, 3).to(torch.float16).contiguous()
