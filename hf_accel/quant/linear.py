"""Drop-in weight-only quantized Linear modules (int8 per output channel, grouped int4) and the swap that installs
them. Parameters hold the checkpoint format of `hf_accel.quant.weights`; `from_float` quantizes an `nn.Linear`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import weights


class Int8Linear(nn.Module):
    """`y = x @ (code * scale).T + bias`; `weight` int32 `[out, in / 4]` (int8 codes), `weight_scale` `[out]`."""

    bits = 8

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None,
                 device: Any = None) -> None:
        super().__init__()
        if in_features % 4:
            raise ValueError(f"int8 weights pack 4 per int32 word: in_features must be a multiple of 4, "
                             f"got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 4, dtype=torch.int32, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        """A quantized copy of `linear` (scale and bias keep its dtype)."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                     linear.weight.device)
        codes, scale = weights.quantize_int8(linear.weight.detach())
        module.weight.data = weights.pack_words(codes, 8)
        module.weight_scale.data = scale.to(linear.weight.dtype)
        return _bias_from(module, linear)

    def forward(self, x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        if not weights.is_aligned(self.weight):  # e.g. memory-mapped from a checkpoint: copy once
            self._realign()
        out = weights.int8_matmul(x, weights.unpack_words(self.weight, 8), self.weight_scale, use_kernel)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @torch.inference_mode(False)
    @torch.no_grad()
    def _realign(self) -> None:
        self.weight = nn.Parameter(weights.aligned(self.weight.detach()), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` this module multiplies by."""
        return weights.dequantize_int8(weights.unpack_words(self.weight, 8), self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """`y = x @ ((code - 8) * scale + zero).T + bias` with one (scale, zero) per `group_size` inputs.

    `weight` int32 `[out, in / 8]` (codes, two per byte) and `weight_qparams` `[in / group, out, 2]` are the checkpoint
    format. On a device with a torch int4 kernel, the first forward re-lays `weight` out into that kernel's opaque
    packing (same bytes); `state_dict` always writes the checkpoint format back, so saving is device independent.
    """

    bits = 4

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = 64,
                 dtype: torch.dtype | None = None, device: Any = None) -> None:
        super().__init__()
        weights.check_group_size(in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 8, dtype=torch.int32, device=device),
                                   requires_grad=False)
        self.weight_qparams = nn.Parameter(
            torch.empty(in_features // group_size, out_features, 2, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.layout: str | None = None  # None: `weight` is in the checkpoint format; else a kernel's packing

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 64) -> Int4Linear:
        """A quantized copy of `linear` (qparams and bias keep its dtype)."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size,
                     linear.weight.dtype, linear.weight.device)
        codes, qparams = weights.quantize_int4(linear.weight.detach(), group_size)
        module.weight.data = weights.pack_words(codes, 4)
        module.weight_qparams.data = qparams.to(linear.weight.dtype)
        return _bias_from(module, linear)

    def forward(self, x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        layout = weights.int4_kernel_layout(x.device, self.out_features) if use_kernel else None
        if layout != self.layout:
            self._relayout(layout)
        if layout is None:
            weight = weights.dequantize_int4(self.codes(), self.weight_qparams, x.dtype)
            out = nn.functional.linear(x, weight)
        else:
            out = weights.int4_kernel_matmul(x, self.weight, self.weight_qparams, layout)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def codes(self) -> torch.Tensor:
        """uint8 codes `[out, in]` in 0..15, whatever the current layout."""
        if self.layout is None:
            return weights.unpack_words(self.weight, 4)
        num_groups = self.in_features // self.group_size
        return weights.unpack_int4_from_kernel(self.weight.detach(), self.in_features, num_groups, self.layout)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` this module multiplies by."""
        return weights.dequantize_int4(self.codes(), self.weight_qparams, dtype)

    @torch.inference_mode(False)
    @torch.no_grad()
    def _relayout(self, layout: str | None) -> None:
        codes = self.codes()
        packed = weights.pack_words(codes, 4) if layout is None else weights.pack_int4_for_kernel(codes, layout)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.layout = layout

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout is not None:  # write the checkpoint format, never a kernel's packing
            destination[prefix + "weight"] = weights.pack_words(self.codes(), 4)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        if self.layout is not None:  # incoming `weight` is in the checkpoint format
            self._relayout(None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}")


def make_quantized_linear(linear: nn.Linear, bits: int, group_size: int, dtype: torch.dtype | None = None,
                          device: Any = None) -> Int8Linear | Int4Linear:
    """An empty quantized module shaped like `linear` (its parameters are filled by loading)."""
    bias = linear.bias is not None
    if bits == 8:
        return Int8Linear(linear.in_features, linear.out_features, bias, dtype, device)
    return Int4Linear(linear.in_features, linear.out_features, bias, group_size, dtype, device)


def _bias_from(module: nn.Module, linear: nn.Linear) -> nn.Module:
    """`module` with a copy of `linear`'s bias, if it has one."""
    if linear.bias is not None:
        module.bias.data = linear.bias.detach().clone()
    return module
