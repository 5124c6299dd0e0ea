"""Drop-in weight-only quantized Linear modules (int8 per output channel, grouped int4) and the swap that installs
them. Parameters hold the checkpoint format of `hf_accel.quant.weights`; `from_float` quantizes an `nn.Linear`.

Each module re-lays its `weight` once for the fastest kernel of the device it runs on (`layout`): on a CPU where
hf_accel's extension builds, 16-column panels (`panels.py`) for `torch.ops.hf_accel.int8_linear` / `int4_linear`,
which dequantize in registers and read each weight byte once for the few rows of a decode; else torch's own int8 /
int4 kernels; else a dequantized matmul. `state_dict` always writes the checkpoint format back, so saving is device
and kernel independent. A compiled graph runs the layout its trace saw: nothing is re-laid while compiling.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

from ..kernels.custom_ops import quantized_linear_kernels
from . import panels, weights


class _QuantizedLinear(nn.Module, abc.ABC):
    """What `Int8Linear` and `Int4Linear` share: `weight` in the checkpoint format (`layout` None) or in a kernel's
    packing of the same codes (`layout` names it), chosen per device by `prepare_kernel` or the first forward."""

    bits: int
    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def forward(self, x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        # the layout is chosen once per device, not per call (choosing asks for the kernel build, under a lock)
        if use_kernel and not torch.compiler.is_compiling() and x.device != self.__dict__.get("_prepared_for"):
            self.prepare_kernel(x.device)
        return self._matmul(x, use_kernel)

    def prepare_kernel(self, device: torch.device | None = None) -> None:
        """Re-lay `weight` for the kernel of `device` (default: where the weight lies), as the first forward would;
        done before compiling, so a compiled graph traces the fast layout."""
        device = torch.device(device) if device is not None else self.weight.device
        layout = self._kernel_layout(device)
        if layout != self.layout:
            self._relayout(layout)
        self.__dict__["_prepared_for"] = device

    @abc.abstractmethod
    def codes(self) -> torch.Tensor:
        """The codes `[out, in]` (int8 for 8 bits, uint8 0..15 for 4), whatever the current layout."""

    @abc.abstractmethod
    def _kernel_layout(self, device: torch.device) -> str | None:
        """The layout of the fastest kernel for inputs on `device`."""

    @abc.abstractmethod
    def _matmul(self, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
        """`x` `[..., in]` @ the dequantized weight (+ bias) -> `[..., out]` in x's dtype, in the current layout."""

    @abc.abstractmethod
    def _packed(self, codes: torch.Tensor, layout: str | None) -> torch.Tensor:
        """`weight` holding `codes` in `layout`."""

    @torch.inference_mode(False)
    @torch.no_grad()
    def _relayout(self, layout: str | None) -> None:
        codes = self.codes()
        self.weight = nn.Parameter(self._packed(codes, layout), requires_grad=False)
        self.layout = layout

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout is not None:  # write the checkpoint format, never a kernel's packing
            destination[prefix + "weight"] = weights.pack_words(self.codes(), self.bits)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        if self.layout is not None:  # incoming `weight` is in the checkpoint format
            self._relayout(None)
        self.__dict__.pop("_prepared_for", None)  # the next forward chooses the layout again
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Int8Linear(_QuantizedLinear):
    """`y = x @ (code * scale).T + bias`; `weight` int32 `[out, in / 4]` (int8 codes), `weight_scale` `[out]` (one
    per output channel) or, with `group_size`, `[out, in / group_size]` (one per group of inputs: GGUF's Q8_0).

    Layouts: None (the checkpoint's words: torch's `_weight_int8pack_mm` on CPU per channel, a dequantized matmul
    grouped) or "panels" (`[out / 16, in, 16]` for `torch.ops.hf_accel.int8_linear`, fp32 accumulation; grouped
    scales in the buffer `weight_scale_panels` `[out / 16, groups, 16]`).
    """

    bits = 8

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None,
                 device: Any = None, group_size: int | None = None) -> None:
        super().__init__()
        if in_features % 4:
            raise ValueError(f"int8 weights pack 4 per int32 word: in_features must be a multiple of 4, "
                             f"got {in_features}")
        if group_size is not None:
            weights.check_group_size(in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 4, dtype=torch.int32, device=device),
                                   requires_grad=False)
        scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.register_buffer("weight_scale_panels", None, persistent=False)  # "panels", grouped: [out / 16, G, 16]
        self.layout: str | None = None

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int | None = None) -> Int8Linear:
        """A quantized copy of `linear` (scale and bias keep its dtype), per channel or in groups of `group_size`."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                     linear.weight.device, group_size)
        codes, scale = weights.quantize_int8(linear.weight.detach(), group_size)
        module.weight.data = weights.pack_words(codes, 8)
        module.weight_scale.data = scale.to(linear.weight.dtype)
        return _bias_from(module, linear)

    def codes(self) -> torch.Tensor:
        if self.layout == "panels":
            return panels.unpack_int8(self.weight, panels.kernel_format())
        return weights.unpack_words(self.weight, 8)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` this module multiplies by."""
        return weights.dequantize_int8(self.codes(), self.weight_scale, dtype)

    def _kernel_layout(self, device: torch.device) -> str | None:
        if device.type != "cpu" or quantized_linear_kernels() is None:
            return None
        return "panels" if panels.fits(self.out_features, self.in_features, panels.kernel_format()) else None

    def _packed(self, codes: torch.Tensor, layout: str | None) -> torch.Tensor:
        return panels.pack_int8(codes, panels.kernel_format()) if layout == "panels" else weights.pack_words(codes, 8)

    def _relayout(self, layout: str | None) -> None:
        grouped = layout == "panels" and self.group_size is not None
        super()._relayout(layout)
        self.weight_scale_panels = panels.pack_int8_scales(self.weight_scale.detach()) if grouped else None

    def _matmul(self, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
        if use_kernel and self.layout == "panels":
            scale = self.weight_scale if self.group_size is None else self.weight_scale_panels
            out = torch.ops.hf_accel.int8_linear(x.reshape(-1, x.shape[-1]), self.weight, scale, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.group_size is not None:  # torch's int8 kernel has one scale per channel
            out = nn.functional.linear(x, self.dequantized_weight(x.dtype))
            return out if self.bias is None else out + self.bias.to(out.dtype)
        compiling = torch.compiler.is_compiling()
        if not compiling and not weights.is_aligned(self.weight):  # e.g. memory-mapped from a checkpoint: copy once
            self._realign()
        # torch's int8 kernel needs aligned memory, which a graph cannot check: compiled, the plain product
        out = weights.int8_matmul(x, self.codes(), self.weight_scale, use_kernel and not compiling)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @torch.inference_mode(False)
    @torch.no_grad()
    def _realign(self) -> None:
        self.weight = nn.Parameter(weights.aligned(self.weight.detach()), requires_grad=False)

    def extra_repr(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{group}"


class Int4Linear(_QuantizedLinear):
    """`y = x @ ((code - 8) * scale + zero).T + bias` with one (scale, zero) per `group_size` inputs.

    `weight` int32 `[out, in / 8]` (codes, two per byte) and `weight_qparams` `[in / group, out, 2]` are the checkpoint
    format. Layouts: None (dequantized matmul), "panels" (`torch.ops.hf_accel.int4_linear`: uint8 `[out / 16, in / 2,
    16]` and the buffer `weight_qpanels`, fp16 scale and minimum per group and column, the scale alone where every
    zero is 0), "cpu" / "cuda" (torch's int4 kernels' opaque packing, computed in bf16).
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
        self.register_buffer("weight_qpanels", None, persistent=False)  # layout "panels": [out / 16, G, 2 or 1, 16]
        self.layout: str | None = None
        self.qparams_fit_fp16 = True  # False once found past fp16's range: torch's kernel instead of the panels

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 64) -> Int4Linear:
        """A quantized copy of `linear` (qparams and bias keep its dtype)."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size,
                     linear.weight.dtype, linear.weight.device)
        codes, qparams = weights.quantize_int4(linear.weight.detach(), group_size)
        module.weight.data = weights.pack_words(codes, 4)
        module.weight_qparams.data = qparams.to(linear.weight.dtype)
        return _bias_from(module, linear)

    def codes(self) -> torch.Tensor:
        if self.layout is None:
            return weights.unpack_words(self.weight, 4)
        if self.layout == "panels":
            return panels.unpack_int4(self.weight, panels.kernel_format())
        num_groups = self.in_features // self.group_size
        return weights.unpack_int4_from_kernel(self.weight.detach(), self.in_features, num_groups, self.layout)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` this module multiplies by."""
        return weights.dequantize_int4(self.codes(), self.weight_qparams, dtype)

    def _kernel_layout(self, device: torch.device) -> str | None:
        usable = device.type == "cpu" and self.qparams_fit_fp16 and quantized_linear_kernels() is not None
        if usable and panels.fits(self.out_features, self.in_features, panels.kernel_format()):
            return "panels"
        return weights.int4_kernel_layout(device, self.out_features)

    def _packed(self, codes: torch.Tensor, layout: str | None) -> torch.Tensor:
        if layout == "panels":
            return panels.pack_int4(codes, panels.kernel_format())
        return weights.pack_words(codes, 4) if layout is None else weights.pack_int4_for_kernel(codes, layout)

    def _relayout(self, layout: str | None) -> None:
        qpanels = panels.pack_int4_params(self.weight_qparams.detach()) if layout == "panels" else None
        if layout == "panels" and qpanels is None:
            self.qparams_fit_fp16 = False
            layout = weights.int4_kernel_layout(self.weight.device, self.out_features)
        super()._relayout(layout)
        self.weight_qpanels = qpanels

    def _matmul(self, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
        if use_kernel and self.layout == "panels":
            out = torch.ops.hf_accel.int4_linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_qpanels,
                                                 self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if use_kernel and self.layout is not None:
            out = weights.int4_kernel_matmul(x, self.weight, self.weight_qparams, self.layout)
        else:
            out = nn.functional.linear(x, self.dequantized_weight(x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}")


# per kind, the attributes that hold `[P, ...]` panels (16 output columns each) in layout "panels", which the kernels
# stream
PANEL_ATTRIBUTES = {Int4Linear: ("weight", "weight_qpanels"), Int8Linear: ("weight", "weight_scale_panels")}


def float_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` as a float module of the same shape holds it: each quantized Linear's `weight` is its
    dequantized weight (in the dtype of its scales) and its scales are left out."""
    state = module.state_dict()
    for name, sub in module.named_modules():
        if isinstance(sub, _QuantizedLinear):
            prefix = f"{name}." if name else ""
            scales = sub.weight_scale if isinstance(sub, Int8Linear) else sub.weight_qparams
            state[prefix + "weight"] = sub.dequantized_weight(scales.dtype)
            state.pop(prefix + ("weight_scale" if isinstance(sub, Int8Linear) else "weight_qparams"))
    return state


def make_quantized_linear(linear: nn.Linear, bits: int, group_size: int, dtype: torch.dtype | None = None,
                          device: Any = None) -> Int8Linear | Int4Linear:
    """An empty quantized module shaped like `linear` (its parameters are filled by loading); `group_size` 0: int8
    per output channel."""
    bias = linear.bias is not None
    if bits == 8:
        return Int8Linear(linear.in_features, linear.out_features, bias, dtype, device, group_size or None)
    return Int4Linear(linear.in_features, linear.out_features, bias, group_size, dtype, device)


def _bias_from(module: nn.Module, linear: nn.Linear) -> nn.Module:
    """`module` with a copy of `linear`'s bias, if it has one."""
    if linear.bias is not None:
        module.bias.data = linear.bias.detach().clone()
    return module
