"""Weight quantization by name: a table of presets -> transformers quantization configs, and a loader.

    model = hf_accel.load_model(path, quant="int8")         # hf_accel's own weight-only int8, CPU and GPU
    model = hf_accel.load_model("model-Q4_0.gguf")          # a llama.cpp file, its Q8_0 / Q4_0 weights kept packed
    config = hf_accel.quantization_config("int4", group_size=32)
    for preset in hf_accel.list_quantization_presets(): print(preset.name, preset.can_run, preset.reason)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM, AutoTokenizer, AwqConfig, BitsAndBytesConfig, FineGrainedFP8Config, GPTQConfig,
    PreTrainedModel, PreTrainedTokenizerBase, QuantoConfig,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from .gguf_file import load_gguf, names_gguf
from .quantizer import WeightOnlyConfig


@dataclass(frozen=True, slots=True)
class Backend:
    """A package a preset imports: `module` is its import name, `package` what to `pip install`."""

    module: str
    package: str

    @property
    def is_installed(self) -> bool:
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # the parent package (`optimum` of `optimum.quanto`) is missing
            return False


BITSANDBYTES = Backend("bitsandbytes", "bitsandbytes")
QUANTO = Backend("optimum.quanto", "optimum-quanto")
OPTIMUM = Backend("optimum.gptq", "optimum")
GPTQMODEL = Backend("gptqmodel", "gptqmodel")


@dataclass(frozen=True, slots=True)
class QuantPreset:
    """One name users pick: `make(**overrides)` builds the transformers config; `needs` is what it takes beyond pip
    packages (empty when nothing); `extra` is the hf_accel pip extra that installs its backends."""

    name: str
    description: str
    make: Callable[..., QuantizationConfigMixin]
    backends: tuple[Backend, ...] = ()
    needs_gpu: bool = False
    needs: str = ""
    extra: str | None = None


PRESETS: tuple[QuantPreset, ...] = (
    QuantPreset("int8", "hf_accel weight-only int8, symmetric per output channel (torch CPU kernel)",
                lambda **kw: WeightOnlyConfig(bits=8, **kw)),
    QuantPreset("int4", "hf_accel weight-only int4, groups of 64 inputs by default (torch CPU / CUDA kernels)",
                lambda **kw: WeightOnlyConfig(bits=4, **kw)),
    QuantPreset("bnb-int8", "bitsandbytes LLM.int8()", lambda **kw: BitsAndBytesConfig(load_in_8bit=True, **kw),
                (BITSANDBYTES,), extra="bnb"),
    QuantPreset("nf4", "bitsandbytes 4-bit NormalFloat",
                lambda **kw: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", **kw),
                (BITSANDBYTES,), extra="bnb"),
    QuantPreset("fp4", "bitsandbytes 4-bit float",
                lambda **kw: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", **kw),
                (BITSANDBYTES,), extra="bnb"),
    QuantPreset("quanto-int8", "optimum-quanto int8 weights", lambda **kw: QuantoConfig(weights="int8", **kw),
                (QUANTO,), extra="quanto"),
    QuantPreset("quanto-int4", "optimum-quanto int4 weights", lambda **kw: QuantoConfig(weights="int4", **kw),
                (QUANTO,), extra="quanto"),
    QuantPreset("awq", "AWQ 4-bit (loaded through gptqmodel; autoawq is archived)",
                lambda **kw: AwqConfig(bits=4, **kw), (GPTQMODEL,),
                needs="an AWQ-quantized checkpoint: transformers cannot quantize to AWQ on load"),
    QuantPreset("gptq", "GPTQ 4-bit", lambda **kw: GPTQConfig(bits=4, **kw), (OPTIMUM, GPTQMODEL),
                needs="a GPTQ checkpoint, or calibration overrides `dataset=` and `tokenizer=` to quantize on load"),
    QuantPreset("fp8", "fine-grained fp8 (128x128 blocks)", lambda **kw: FineGrainedFP8Config(**kw), needs_gpu=True,
                needs="a GPU with compute capability >= 8.9; on CPU fp8 checkpoints are dequantized to bf16"),
)
PRESETS_BY_NAME = {preset.name: preset for preset in PRESETS}


@dataclass(frozen=True, slots=True)
class PresetStatus:
    """Whether a preset can run here; `reason` says why not (None when it can)."""

    name: str
    description: str
    packages: tuple[str, ...]
    needs: str
    can_run: bool
    reason: str | None


def _missing(preset: QuantPreset) -> list[str]:
    return [backend.package for backend in preset.backends if not backend.is_installed]


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _install_hint(preset: QuantPreset, missing: list[str]) -> str:
    hint = f"pip install {' '.join(missing)}"
    return hint + (f" (or: pip install 'hf_accel[{preset.extra}]')" if preset.extra else "")


def get_preset(name: str) -> QuantPreset:
    """The preset called `name`; `ValueError` listing the known names otherwise."""
    if name not in PRESETS_BY_NAME:
        raise ValueError(f"unknown quantization preset {name!r}; known presets: {', '.join(PRESETS_BY_NAME)}")
    return PRESETS_BY_NAME[name]


def quantization_config(name: str, **overrides: Any) -> QuantizationConfigMixin:
    """The transformers quantization config of preset `name`, with `overrides` passed to its config class.

    `ValueError` for an unknown name (listing the known ones); `ImportError` naming what to `pip install` when the
    preset's backend is missing.
    """
    preset = get_preset(name)
    missing = _missing(preset)
    if missing:
        raise ImportError(f"quantization preset {name!r} needs {', '.join(missing)}: {_install_hint(preset, missing)}")
    return preset.make(**overrides)


def list_quantization_presets() -> list[PresetStatus]:
    """Every preset, with whether it can run in this environment and, if not, why (missing package, needs a GPU)."""
    statuses = []
    for preset in PRESETS:
        missing = _missing(preset)
        reason = None
        if missing:
            reason = f"missing {', '.join(missing)}: {_install_hint(preset, missing)}"
        elif preset.needs_gpu and not _has_fp8_gpu():
            reason = f"needs a GPU: {preset.needs}"
        statuses.append(PresetStatus(preset.name, preset.description, tuple(b.package for b in preset.backends),
                                     preset.needs, reason is None, reason))
    return statuses


def load_tokenizer(path_or_id: str) -> PreTrainedTokenizerBase:
    """The tokenizer beside `load_model(path_or_id)`: `AutoTokenizer.from_pretrained(path_or_id)`, or for a GGUF file
    the one it holds (transformers reads it: `from_pretrained(folder, gguf_file=name)`)."""
    if names_gguf(path_or_id):
        path = Path(path_or_id)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path_or_id)


def load_model(path_or_id: str, quant: str | QuantizationConfigMixin | None = None, **kwargs: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path_or_id, quantization_config=..., **kwargs)` with `quant` a preset
    name (see `list_quantization_presets`), a quantization config, or None (no quantization).

    A GGUF file (`path_or_id` ending in `.gguf`) loads with `load_gguf`: its Q8_0 / Q4_0 weights stay packed
    (`quant` must be None; `kwargs` may hold `dtype`)."""
    if names_gguf(path_or_id):
        if quant is not None:
            raise ValueError(f"quant must be None for a GGUF file (its weights are quantized already), got {quant!r}")
        return load_gguf(path_or_id, **kwargs)
    config = quantization_config(quant) if isinstance(quant, str) else quant
    if config is not None:
        kwargs["quantization_config"] = config
    return AutoModelForCausalLM.from_pretrained(path_or_id, **kwargs)
