"""hf_accel's weight-only method in transformers' quantizer registry: `hf_accel_int8` and `hf_accel_int4`.

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=WeightOnlyConfig(bits=4, group_size=64))
    model.save_pretrained(out)                      # pre-quantized checkpoint (format: hf_accel.quant.weights)
    AutoModelForCausalLM.from_pretrained(out)       # reloads it bit for bit, with hf_accel imported
    quantized = quantize_model(model, WeightOnlyConfig(bits=8))  # the same, from a float model in memory

Every `nn.Linear` but the output embedding (and tied or `modules_to_not_convert` modules) becomes an `Int8Linear` /
`Int4Linear`; embeddings are not Linear layers and stay as they are. Without hf_accel imported, stock transformers
warns that it does not know the method and then fails on the packed `weight` shapes (see `weights`), never
loading codes as floats.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from . import weights
from .linear import Int4Linear, Int8Linear, make_quantized_linear
from .panel_memory import move_panels_to_huge_pages
from .sibling_linears import colocate_siblings

METHODS = {8: "hf_accel_int8", 4: "hf_accel_int4"}  # bits -> quant_method
FORMAT_VERSION = 1
DEFAULT_GROUP_SIZE = 64


class WeightOnlyConfig(QuantizationConfigMixin):
    """Weight-only quantization: `bits=8` (symmetric, per output channel, or per `group_size` inputs when given) or
    `bits=4` (asymmetric, one scale and zero per `group_size` inputs, 64 by default). Group sizes: 32, 64, 128 or 256,
    dividing every converted layer's in_features.

    `modules_to_not_convert`: names or patterns kept in float on top of the defaults (output embedding, tied weights).
    `module_formats`: exact module names -> `{"bits": ..., "group_size": ...}` for Linears quantized otherwise than
    the rest, the output layer included (a GGUF file's mix of Q8_0 and Q4_0 layers, saved and reloaded as it is).
    """

    def __init__(self, bits: int = 8, group_size: int | None = None, modules_to_not_convert: list[str] | None = None,
                 format_version: int = FORMAT_VERSION, module_formats: dict[str, dict[str, Any]] | None = None,
                 **kwargs: Any) -> None:  # kwargs: `quant_method` from a dict
        bits, group_size = _checked_format(bits, group_size, "")
        for name, entry in (module_formats or {}).items():
            if not isinstance(entry, dict) or set(entry) - {"bits", "group_size"} or "bits" not in entry:
                raise ValueError(f"module_formats[{name!r}] must be a dict with 'bits' and optionally 'group_size', "
                                 f"got {entry!r}")
            _checked_format(entry["bits"], entry.get("group_size"), f"module_formats[{name!r}]: ")
        if format_version != FORMAT_VERSION:
            raise ValueError(f"checkpoint format_version {format_version} is not {FORMAT_VERSION}; "
                             "upgrade hf_accel to load it")
        self.quant_method = METHODS[bits]
        self.bits = bits
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert
        self.format_version = format_version
        self.module_formats = module_formats

    def format_of(self, module_name: str) -> tuple[int, int]:
        """(bits, group size; 0 for int8 per channel) of the Linear `module_name`."""
        entry = (self.module_formats or {}).get(module_name)
        if entry is None:
            return self.bits, self.group_size or 0
        bits, group_size = _checked_format(entry["bits"], entry.get("group_size"), "")
        return bits, group_size or 0


def _checked_format(bits: int, group_size: int | None, where: str) -> tuple[int, int | None]:
    """(bits, group_size) with int4's default group; `ValueError` (prefixed by `where`) for values outside the
    supported ones."""
    if bits not in METHODS:
        raise ValueError(f"{where}bits must be one of {sorted(METHODS)}, got {bits}")
    if bits == 4 and group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    if group_size is not None and group_size not in weights.INT4_GROUP_SIZES:
        raise ValueError(f"{where}group_size must be one of {weights.INT4_GROUP_SIZES} (or None for int8 per "
                         f"channel), got {group_size}")
    return bits, group_size


class WeightOnlyQuantize(ConversionOps):
    """Quantize-on-load: a float `weight` `[out, in]` -> the target module's packed `weight` and its scales."""

    def __init__(self, hf_quantizer: WeightOnlyQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: nn.Module | None = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        value = next(iter(input_dict.values()))
        weight = value[0] if isinstance(value, list) else value
        module, _ = get_module_from_name(model, full_layer_name)
        if isinstance(module, Int8Linear):
            codes, scale = weights.quantize_int8(weight, module.group_size)
            return {full_layer_name: weights.pack_words(codes, 8),
                    full_layer_name + "_scale": scale.to(module.weight_scale.dtype)}
        codes, qparams = weights.quantize_int4(weight, module.group_size)
        return {full_layer_name: weights.pack_words(codes, 4),
                full_layer_name + "_qparams": qparams.to(module.weight_qparams.dtype)}


class WeightOnlyQuantizer(HfQuantizer):
    """Swaps Linear layers for `Int8Linear` / `Int4Linear` before loading; quantizes float checkpoints on load."""

    requires_calibration = False
    quantization_config: WeightOnlyConfig

    def __init__(self, quantization_config: WeightOnlyConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.tied_to_quantize: list[str] = []  # tied Linears named in module_formats: quantized after loading

    @property
    def quantized_element_size(self) -> float:
        return self.quantization_config.bits / 8

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        module, name = get_module_from_name(model, param_name)
        return not self.pre_quantized and name == "weight" and isinstance(module, (Int8Linear, Int4Linear))

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        config = self.quantization_config
        self.modules_to_not_convert = modules_kept_float(model, config)
        # a tied layer named in module_formats loads in float (tied to its source), then gets its own quantized copy
        self.tied_to_quantize = [] if self.pre_quantized else tied_linears(model, config)
        replace_linear_modules(model, config, self.modules_to_not_convert, exclude=self.tied_to_quantize)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for name in self.tied_to_quantize:
            format_ = self.quantization_config.format_of(name)
            model.set_submodule(name, quantize_linear(model.get_submodule(name), *format_))
        untie(model, self.tied_to_quantize)
        prepare_kernels(model)
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        """transformers compiles the decode steps of `compile_config`: the kernels are custom ops with fakes."""
        return True

    def get_quantize_ops(self) -> WeightOnlyQuantize:
        return WeightOnlyQuantize(self)


def modules_kept_float(model: PreTrainedModel, config: WeightOnlyConfig) -> list[str]:
    """Names or patterns of the modules left in float: `config.modules_to_not_convert`, the model's fp32 modules,
    and transformers' defaults (the output embedding, tied weights)."""
    return HfQuantizer.get_modules_to_not_convert(
        model, config.modules_to_not_convert, model._keep_in_fp32_modules, add_default_skips=True)


def quantize_model(model: PreTrainedModel, config: WeightOnlyConfig, progress: bool = True) -> PreTrainedModel:
    """A weight-quantized copy of the float `model` (which is left as it is, and whose float Linear weights are never
    copied): the Linear layers that `from_pretrained(..., quantization_config=config)` converts become `Int8Linear` /
    `Int4Linear` with the codes quantize-on-load gives for the same weights; everything else is deep-copied. The
    copy carries `config` as its `quantization_config`, so `save_pretrained` writes a pre-quantized checkpoint.
    `progress`: a `tqdm.auto` bar over the layers. `ValueError` names a layer whose in_features the int4 group size
    does not divide."""
    targets = linears_to_convert(model, config, modules_kept_float(model, config))
    memo: dict[int, Any] = {}  # deepcopy takes each converted Linear's quantized module instead of copying it
    for name, module in tqdm(targets, desc=f"quantize int{config.bits}", unit="layer", disable=not progress):
        try:
            memo[id(module)] = quantize_linear(module, *config.format_of(name))
        except ValueError as error:
            raise ValueError(f"cannot quantize {name!r}: {error}") from None
    quantized = copy.deepcopy(model, memo)
    untie(quantized, tied_linears(model, config))
    quantized.hf_quantizer = WeightOnlyQuantizer(config, pre_quantized=False)
    quantized.hf_quantizer.postprocess_model(quantized)  # sets config.quantization_config, as from_pretrained does
    return quantized


def prepare_kernels(model: nn.Module) -> None:
    """Re-lay every quantized Linear of `model` for the kernel of the device its weight is on (as a first forward
    would), so a model compiled before it ever ran eagerly traces the fast layout; then put siblings' panels end to
    end and every CPU panel on huge pages (`panel_memory.py`)."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            module.prepare_kernel()
    colocate_siblings(model)  # compiled steps then run each group of siblings as one call
    move_panels_to_huge_pages(model)  # last: the panels' final storages


def quantize_linear(linear: nn.Linear, bits: int, group_size: int) -> Int8Linear | Int4Linear:
    """A quantized copy of `linear`: `Int8Linear` (bits 8; `group_size` 0: per channel) or `Int4Linear` with groups
    of `group_size` (bits 4)."""
    quantized = (Int8Linear.from_float(linear, group_size or None) if bits == 8
                 else Int4Linear.from_float(linear, group_size))
    return quantized.train(linear.training)


def replace_linear_modules(model: nn.Module, config: WeightOnlyConfig, skip: list[str] | None = None,
                           exclude: Sequence[str] = ()) -> int:
    """Replace every `nn.Linear` of `model` not matched by `skip` (or named in `config.module_formats`), the names in
    `exclude` aside, with an empty quantized module of its format on the meta device; returns how many. `ValueError`
    names the layer whose in_features the group size does not divide."""
    targets = [(name, linear) for name, linear in linears_to_convert(model, config, skip) if name not in exclude]
    for name, linear in targets:
        bits, group_size = config.format_of(name)
        try:
            with torch.device("meta"):
                quantized = make_quantized_linear(linear, bits, group_size, dtype=linear.weight.dtype)
        except ValueError as error:
            raise ValueError(f"cannot quantize {name!r}: {error}") from None
        model.set_submodule(name, quantized)
    return len(targets)


def linears_to_convert(model: nn.Module, config: WeightOnlyConfig,
                       skip: list[str] | None) -> list[tuple[str, nn.Linear]]:
    """(name, module) of each `nn.Linear` that `config` quantizes: those named in `config.module_formats` (the output
    layer too), and every other one not matched by `skip`."""
    named = config.module_formats or {}
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and (name in named or should_convert_module(name, skip))]


def tied_linears(model: PreTrainedModel, config: WeightOnlyConfig) -> list[str]:
    """Names in `config.module_formats` of Linears whose weight is tied to another parameter (the output layer of a
    model with `tie_word_embeddings`): quantized, they get their own weight, and the tie goes."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return [name for name in config.module_formats or {} if f"{name}.weight" in tied]


def untie(model: PreTrainedModel, names: list[str]) -> None:
    """Drop the ties of the Linears `names` (now quantized, with weights of their own), in the model's tie map and its
    config, so neither a later `tie_weights` nor a save / reload ties them back."""
    if not names:
        return
    model.all_tied_weights_keys = {target: source for target, source in model.all_tied_weights_keys.items()
                                   if target.removesuffix(".weight") not in names}
    if not model.all_tied_weights_keys:  # the config's switch covers every tie: off only once none is left
        for config in (model.config, model.config.get_text_config()):
            config.tie_word_embeddings = False
