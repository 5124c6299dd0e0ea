"""What `hf-accel serve` serves: an `EngineSpec` (the model folder, its weight preset and dtype, the engine's
`EngineConfig` and `SpeculativeConfig`), built into an `Engine` in this process or, by default, in an engine-core
process of its own (`EngineProcess`: the model step then never waits on the server's Python work)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.engine_process import EngineProcess
from ..engine.spec_decode.speculative_config import SpeculativeConfig
from ..lora.config import LoRAConfig
from ..quant.presets import load_model, load_tokenizer
from ..reference import ASSETS_DIR
from .speculative_option import ModelFolder

ServedEngine = Engine | EngineProcess


@dataclass(frozen=True)
class EngineSpec:
    """How to build the served engine, picklable (sent to the engine-core process): `model` a local folder or hub id
    (None: the reference target), `quant` a weight preset or None, `dtype`, torch's CPU `threads` (None: torch's
    default), the engine's `config`, its `speculative` config (Medusa heads travel as objects; an EAGLE head or a
    draft model as a `ModelFolder`, loaded beside the served model) and its `lora` limits (None: no adapters)."""

    model: str | None
    quant: str | None
    dtype: torch.dtype
    threads: int | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    speculative: SpeculativeConfig | ModelFolder | None = None
    lora: LoRAConfig | None = None

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(model_source(self.model))


def model_source(path: str | None) -> str:
    """Where the served model loads from: `path`, or the reference target's folder when None."""
    return str(ASSETS_DIR / "target") if path is None else path


def load_served_model(path: str | None, quant: str | None,
                      dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (quantized with the `quant` preset, if any) in eval mode and its tokenizer; `path` None is the
    reference target, a `.gguf` file loads packed (`hf_accel.load_gguf`) with the tokenizer it holds."""
    source = model_source(path)
    return load_model(source, quant=quant, dtype=dtype).eval(), load_tokenizer(source)


def build_engine(spec: EngineSpec) -> Engine:
    """The spec's engine in this process (with `spec.threads` set for torch first)."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    model, tokenizer = load_served_model(spec.model, spec.quant, spec.dtype)
    speculative = spec.speculative
    if isinstance(speculative, ModelFolder):  # a head loads for the model it serves, a draft beside it
        speculative = speculative.config_for(model)
    return Engine(model, tokenizer, config=spec.config, speculative=speculative, lora=spec.lora)


def serve_engine(spec: EngineSpec, tokenizer: PreTrainedTokenizerBase, in_process: bool = False) -> ServedEngine:
    """The engine to serve (`tokenizer`: the spec's): an `EngineProcess` building `spec` in its own process, or
    with `in_process` an `Engine` here."""
    if in_process:
        return build_engine(spec)
    return EngineProcess(partial(build_engine, spec), tokenizer)
