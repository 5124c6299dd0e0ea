"""Pure tensor functions of weight-only quantization: quantize, pack into int32 words, dequantize, matmul.

Checkpoint format (device independent; what `save_pretrained` writes for `hf_accel_int8` / `hf_accel_int4`):
- int8: `weight` int32 `[out, in / 4]` holds the int8 codes `[out, in]` (symmetric, per output channel), four per
  word in memory order; `weight_scale` `[out]`: `w ~= code * scale`, or `[out, in / group]` for int8 in groups of
  inputs (GGUF's Q8_0 is group 32): `w[o, i] ~= code * scale[o, i // group]`.
- int4: `weight` int32 `[out, in / 8]` holds codes 0..15 `[out, in]`, two per byte (even `k` in the low nibble),
  bytes in memory order; `weight_qparams` `[in / group, out, 2]` (scale, zero): `w ~= (code - 8) * scale + zero`,
  the layout torch's int4 kernels take as is.
The stored `weight` never has a float Linear's shape `[out, in]`, so a stock transformers load of such a checkpoint
fails with a size mismatch instead of reading codes as float weights. Words are little-endian (as safetensors).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_OFFSET = 8  # int4 codes are 0..15; the kernels subtract 8
CPU_INT4_INNER_K_TILES = 2
CUDA_INT4_INNER_K_TILES = 2
# The kernels run on bf16 activations: torch 2.13's CPU weight-only kernels take a 4-8x slower path for fp32 inputs
# (measured at hidden 256-1024, one thread), and the CUDA int4 kernel takes bf16 only. Outputs return in x's dtype.
KERNEL_DTYPE = torch.bfloat16
KERNEL_ALIGNMENT = 64  # bytes; the CPU int8 kernel crashes (SIGSEGV) on unaligned weights or inputs, e.g. mmapped ones


def is_aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % KERNEL_ALIGNMENT == 0


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a contiguous copy of it in a fresh (64-byte aligned) allocation when it is not aligned."""
    return tensor.contiguous() if is_aligned(tensor) else tensor.clone(memory_format=torch.contiguous_format)


def check_group_size(in_features: int, group_size: int) -> None:
    """`ValueError` unless `group_size` is one of `INT4_GROUP_SIZES` and divides `in_features`."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {in_features}")


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[out, in]` -> (int8 codes `[out, in]` in -127..127, fp32 scale `[out]`, or `[out, in / group_size]`
    with `group_size`, each a value of fp16, GGUF's Q8_0 rule); symmetric per row or per group of inputs."""
    w = weight.float()
    if group_size is None:
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
    check_group_size(w.shape[1], group_size)
    grouped = w.reshape(w.shape[0], -1, group_size)  # [out, groups, group]
    # fp16 scales, as the kernels read them (and Q8_0 stores them); the codes are rounded against the stored scale
    scale = (grouped.abs().amax(dim=-1) / 127).clamp(min=2**-24).to(torch.float16).float()  # [out, groups]
    codes = torch.round(grouped / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(w.shape), scale


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[out, in]` -> (uint8 codes `[out, in]` in 0..15, fp32 qparams `[in / group, out, 2]`).

    Asymmetric per group of `group_size` inputs: code 0 is the group minimum, code 15 its maximum.
    """
    out_features, in_features = weight.shape
    check_group_size(in_features, group_size)
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
    scale = ((high - low) / 15).clamp(min=1e-12)
    zero = low + INT4_OFFSET * scale  # (code - 8) * scale + zero == code * scale + low
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    qparams = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return codes.reshape(out_features, in_features), qparams


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `[out, in]` (int8 for 8 bits, uint8 0..15 for 4) -> int32 words `[out, in * bits / 32]`."""
    if bits == 8:
        return codes.to(torch.int8).contiguous().view(torch.int32)
    assert bits == 4, bits
    low, high = codes[:, 0::2], codes[:, 1::2]
    return (low | (high << 4)).to(torch.uint8).contiguous().view(torch.int32)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_words`: int32 words `[out, w]` -> int8 codes `[out, 4w]` or uint8 codes `[out, 8w]`."""
    if bits == 8:
        return words.view(torch.int8)
    assert bits == 4, bits
    packed = words.view(torch.uint8)  # [out, in / 2]
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 codes `[out, in]`, scale `[out]` or `[out, groups]` -> weight `[out, in]` in `dtype`."""
    if scale.dim() == 1:
        return codes.to(dtype) * scale.to(dtype)[:, None]
    grouped = codes.to(dtype).reshape(codes.shape[0], scale.shape[1], -1)  # [out, groups, group]
    return (grouped * scale.to(dtype)[..., None]).reshape(codes.shape)


def dequantize_int4(codes: torch.Tensor, qparams: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes `[out, in]`, qparams `[groups, out, 2]` -> weight `[out, in]` in `dtype`."""
    group_size = codes.shape[1] // qparams.shape[0]
    scale, zero = (qparams[..., i].to(dtype).t().repeat_interleave(group_size, dim=1) for i in (0, 1))
    return (codes.to(dtype) - INT4_OFFSET) * scale + zero


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """`x` `[..., in]` @ dequantized(codes `[out, in]`, scale `[out]`).T -> `[..., out]` in x's dtype.

    On CPU the kernel is `aten._weight_int8pack_mm` (in `KERNEL_DTYPE`; `codes` must be 64-byte aligned, see
    `aligned`); elsewhere (or with `use_kernel=False`) the same product in plain torch in x's dtype:
    `(x @ codes.T) * scale`.
    """
    rows = x.reshape(-1, x.shape[-1])
    if use_kernel and x.device.type == "cpu":
        assert is_aligned(codes), "int8 kernel weights must be 64-byte aligned"
        kernel_rows, kernel_scale = aligned(rows.to(KERNEL_DTYPE)), scale.to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(kernel_rows, codes, kernel_scale).to(x.dtype)
    else:
        out = F.linear(rows, codes.to(x.dtype)) * scale.to(x.dtype)
    return out.reshape(*x.shape[:-1], codes.shape[0])


def int4_kernel_layout(device: torch.device, out_features: int) -> str | None:
    """Which torch int4 kernel applies on `device`: "cpu" (needs out % 16 == 0), "cuda" (out % 8 == 0) or None."""
    if device.type == "cpu" and out_features % 16 == 0:
        return "cpu"
    if device.type == "cuda" and out_features % 8 == 0:
        return "cuda"
    return None


def pack_int4_for_kernel(codes: torch.Tensor, layout: str) -> torch.Tensor:
    """uint8 codes `[out, in]` -> the opaque packed weight of torch's int4 kernel for `layout` ("cpu" or "cuda")."""
    if layout == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), CPU_INT4_INNER_K_TILES)
    assert layout == "cuda", layout
    high_even = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # the CUDA packer wants even k high
    return torch.ops.aten._convert_weight_to_int4pack(high_even.contiguous(), CUDA_INT4_INNER_K_TILES)


def int4_kernel_matmul(x: torch.Tensor, packed: torch.Tensor, qparams: torch.Tensor, layout: str) -> torch.Tensor:
    """`x` `[..., in]` @ the int4 weight packed by `pack_int4_for_kernel(.., layout)` -> `[..., out]` in x's dtype,
    computed in `KERNEL_DTYPE`."""
    rows = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE).contiguous()
    group_size = x.shape[-1] // qparams.shape[0]
    qparams = qparams.to(KERNEL_DTYPE)
    if layout == "cpu":
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, qparams)
    else:
        out = torch.ops.aten._weight_int4pack_mm(rows, packed, group_size, qparams)
    return out.to(x.dtype).reshape(*x.shape[:-1], qparams.shape[1])


def unpack_int4_from_kernel(packed: torch.Tensor, in_features: int, num_groups: int, layout: str) -> torch.Tensor:
    """Inverse of `pack_int4_for_kernel`: uint8 codes `[out, in]`. The packed layout is opaque (it differs by CPU
    instruction set), so the kernel itself reads it back: identity @ W with scale 1 and zero 0 gives `codes - 8`."""
    dtype = KERNEL_DTYPE  # exact for integers -8..7
    eye = torch.eye(in_features, dtype=dtype, device=packed.device)
    out_features = packed.shape[0] if layout == "cpu" else packed.shape[0] * 8
    qparams = torch.zeros(num_groups, out_features, 2, dtype=dtype, device=packed.device)
    qparams[..., 0] = 1
    centered = int4_kernel_matmul(eye, packed, qparams, layout)  # [in, out]
    return (centered.t() + INT4_OFFSET).round().to(torch.uint8)
