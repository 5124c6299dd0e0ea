"""Weight-only int8 / int4 checkpoints in the compressed-tensors format, written with the `compressed-tensors` library.

The quantization config is built from the library's own classes and the packing is the library's
(`ModelCompressor.compress_model`, format "pack-quantized"); this module only decides the scheme and fills in each
layer's scales. The schemes are the two vLLM runs as weight-only W8A16 / W4A16 (`CompressedTensorsWNA16` with the
GPTQ-style symmetric types `uint8b128` / `uint4b8`, see docs/export.md for the source lines):

- int8: symmetric, one scale per output channel, codes -127..127. The scale is hf_accel's own
  (`hf_accel.quant.weights.quantize_int8`: `absmax / 127`), so the export holds the codes of `Int8Linear`.
- int4: symmetric, one scale per `group_size` inputs (the largest of 128, 64, 32 dividing every converted layer),
  codes -8..7 with the library's `calculate_qparams` (`scale = absmax / 7.5`). hf_accel's `Int4Linear` is
  asymmetric (scale and float minimum per group), which vLLM's symmetric W4A16 kernels cannot hold; the difference
  is measured in docs/export.md.

Every `nn.Linear` is converted except the output embedding (`lm_head`, tied or not), which stays in bf16 as vLLM
expects (`ignore: ["lm_head"]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStrategy,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils import update_offload_parameter
from torch import nn
from transformers import PreTrainedModel

from ..quant import weights

FORMAT = CompressionFormat.pack_quantized.value  # the only weight-only int format vLLM's WNA16 scheme accepts
GROUP_SIZES = (128, 64, 32)  # vLLM's Marlin W4A16 kernel: group sizes -1 (channel), 32, 64, 128
IGNORED = ("lm_head",)


@dataclass(frozen=True, slots=True)
class ExportQuant:
    """A weight-only scheme for export: `bits` 8 (per output channel) or 4 (per group of inputs)."""

    name: str
    bits: int
    strategy: str

    def weight_args(self, group_size: int | None) -> QuantizationArgs:
        """The compressed-tensors `QuantizationArgs` of this scheme (`group_size` only for group strategies)."""
        grouped = self.strategy == QuantizationStrategy.GROUP.value
        return QuantizationArgs(num_bits=self.bits, type="int", symmetric=True, strategy=self.strategy,
                                group_size=group_size if grouped else None)


EXPORT_QUANTS = {
    "int8": ExportQuant("int8", 8, QuantizationStrategy.CHANNEL.value),
    "int4": ExportQuant("int4", 4, QuantizationStrategy.GROUP.value),
}


def export_quant(name: str) -> ExportQuant:
    """The scheme called `name`; `ValueError` naming `quant` and the choices otherwise."""
    if name not in EXPORT_QUANTS:
        raise ValueError(f"quant must be one of {sorted(EXPORT_QUANTS)}, got {name!r}")
    return EXPORT_QUANTS[name]


def converted_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers an export quantizes: all but the ignored output embedding."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in IGNORED}


def largest_group_size(in_features: list[int]) -> int:
    """The largest of `GROUP_SIZES` dividing every entry of `in_features`; `ValueError` when none does."""
    for size in GROUP_SIZES:
        if all(width % size == 0 for width in in_features):
            return size
    raise ValueError(f"int4 export needs every quantized layer's in_features to be a multiple of one of "
                     f"{GROUP_SIZES} (vLLM's W4A16 group sizes); got in_features {sorted(set(in_features))}")


def quantization_config(model: nn.Module, quant: ExportQuant) -> QuantizationConfig:
    """The compressed-tensors config for `model` under `quant`: one group targeting `Linear`, `lm_head` ignored."""
    linears = converted_linears(model)
    if not linears:
        raise ValueError("model has no Linear layers to quantize besides lm_head")
    group = largest_group_size([m.in_features for m in linears.values()]) if quant.bits == 4 else None
    scheme = QuantizationScheme(targets=["Linear"], weights=quant.weight_args(group), format=FORMAT)
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(IGNORED), format=FORMAT)


def weight_scale(weight: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """Scales `[out, 1]` (channel) or `[out, in / group]` (group) for `weight` `[out, in]`, in fp32.

    8 bits: hf_accel's int8 scale (`absmax / 127`); 4 bits: the library's `calculate_qparams` over each group."""
    if args.num_bits == 8 and args.strategy == QuantizationStrategy.CHANNEL.value:
        return weights.quantize_int8(weight)[1].float()[:, None]
    grouped = weight.float().reshape(weight.shape[0], -1, args.group_size)  # [out, groups, group]
    scale, _ = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
    return scale


def compress(model: PreTrainedModel, config: QuantizationConfig) -> ModelCompressor:
    """Quantize `model` in place into the packed compressed-tensors layout (`weight_packed`, `weight_scale`,
    `weight_shape` per converted Linear) under `config` (from `quantization_config`) and return the compressor
    whose `update_config` writes `config` into a saved folder's config.json."""
    apply_quantization_config(model, config)
    args = config.config_groups["group_0"].weights
    with torch.no_grad():
        for module in converted_linears(model).values():
            scale = weight_scale(module.weight.detach(), args)
            update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))
            # the library divides in the weight's dtype: bf16 has a 0.5 spacing above 64, so codes could be off
            # by more than half a step; in fp32 they are round-to-nearest with the stored (bf16) scale
            module.weight = nn.Parameter(module.weight.detach().float(), requires_grad=False)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMAT)
    compressor.compress_model(model)
    return compressor


def save_compressed(model: PreTrainedModel, config: QuantizationConfig, folder: Path) -> None:
    """Write `model` (bf16 or fp16 weights) to `folder` as a compressed-tensors checkpoint under `config`:
    safetensors plus a `config.json` carrying the `quantization_config` transformers and vLLM read. `model` is
    modified in place."""
    compressor = compress(model, config)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))


def unpack_codes(weight_packed: torch.Tensor, bits: int, weight_shape: torch.Tensor) -> torch.Tensor:
    """The signed codes `[out, in]` (int8 tensor) of a checkpoint's `weight_packed`, by the library's unpacking."""
    return unpack_from_int32(weight_packed, bits, torch.Size(weight_shape.tolist()))
