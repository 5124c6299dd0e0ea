"""`hf-accel serve --speculative-config JSON`: vLLM's flag, parsed into a `SpeculativeConfig`.

    --speculative-config '{"method": "suffix", "num_speculative_tokens": 5}'
    --speculative-config '{"method": "ngram", "prompt_lookup_max": 4}'
    --speculative-config '{"method": "medusa", "model": "PATH"}'     # a MedusaHeads.save_pretrained folder
    --speculative-config '{"method": "eagle3", "model": "PATH"}'     # an EagleHead.save_pretrained folder
    --speculative-config '{"method": "draft", "model": "PATH"}'      # a draft model's save_pretrained folder

Keys are `SpeculativeConfig`'s fields; for "medusa", `model` is the heads' folder (loaded here, in `dtype`); for
"eagle3", an EAGLE head's folder, for "draft", a causal LM's folder: checked here and loaded where the engine is
built, after the served model (a head is made for one model; either may be large: `ModelFolder`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..engine.spec_decode.speculative_config import CHAIN_MODELS, SpeculativeConfig, check_model_options
from ..speculative.eagle_head import CONFIG_NAME as EAGLE_CONFIG_NAME
from ..speculative.eagle_head import EagleHead
from ..speculative.medusa_heads import MedusaHeads

EXAMPLE = '{"method": "suffix", "num_speculative_tokens": 5}'


@dataclass(frozen=True)
class ModelFolder:
    """`--speculative-config` with method "eagle3" or "draft": the head's or draft model's folder and the other
    fields, made into a `SpeculativeConfig` for the served model once it is loaded (`config_for`); picklable, for the
    engine process."""

    method: str
    path: Path
    options: dict
    dtype: torch.dtype

    def config_for(self, model: PreTrainedModel) -> SpeculativeConfig:
        """The config with the head (for `model`: `ValueError` when it was made for another model) or the draft
        model loaded."""
        if self.method == "eagle3":
            loaded = EagleHead.from_pretrained(self.path, model, dtype=self.dtype)
        else:
            loaded = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).eval()
        return SpeculativeConfig(self.method, **self.options, model=loaded)


def parse_speculative_config(text: str, dtype: torch.dtype) -> SpeculativeConfig | ModelFolder:
    """The `SpeculativeConfig` that `text` (a JSON object) describes (for "eagle3" and "draft", a `ModelFolder`);
    ValueError
    naming what is wrong (bad JSON, not an object, unknown keys with the allowed ones, a value the config refuses, a
    heads folder that cannot be read)."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config must be a JSON object such as '{EXAMPLE}': {error}") from None
    if not isinstance(options, dict):
        raise ValueError(f"--speculative-config must be a JSON object such as '{EXAMPLE}', got {text!r}")
    allowed = [field.name for field in dataclasses.fields(SpeculativeConfig)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"--speculative-config has unknown keys {unknown}; allowed: {', '.join(allowed)}")
    if "method" not in options:
        raise ValueError(f"--speculative-config needs a `method`, e.g. '{EXAMPLE}'")
    if options["method"] == "medusa":
        options["model"] = _load_heads(options.get("model"), dtype)
    try:
        if options["method"] in CHAIN_MODELS:
            return _model_folder(options, dtype)
        return SpeculativeConfig(**options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--speculative-config: {error}") from None


def _model_folder(options: dict, dtype: torch.dtype) -> ModelFolder:
    method, path = options.pop("method"), options.pop("model", None)
    what, marker = ("EAGLE head", EAGLE_CONFIG_NAME) if method == "eagle3" else ("draft model", "config.json")
    if not isinstance(path, str):
        raise ValueError(f"method {method!r} needs `model`, the path of a saved {what}'s folder, got {path!r}")
    if not (Path(path) / marker).is_file():
        raise ValueError(f"no {what} in {path!r} (no {marker})")
    check_model_options(options, method)
    return ModelFolder(method, Path(path), options, dtype)


def _load_heads(path: object, dtype: torch.dtype) -> MedusaHeads:
    if not isinstance(path, str):
        raise ValueError(f"--speculative-config: method 'medusa' needs `model`, the path of a MedusaHeads folder, got "
                         f"{path!r}")
    try:
        return MedusaHeads.from_pretrained(Path(path), dtype=dtype)
    except OSError as error:
        raise ValueError(f"--speculative-config: cannot load Medusa heads from {path!r}: {error}") from None
