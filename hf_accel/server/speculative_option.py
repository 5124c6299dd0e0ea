"""`hf-accel serve --speculative-config JSON`: vLLM's flag, parsed into a `SpeculativeConfig`.

    --speculative-config '{"method": "suffix", "num_speculative_tokens": 5}'
    --speculative-config '{"method": "ngram", "prompt_lookup_max": 4}'
    --speculative-config '{"method": "medusa", "model": "PATH"}'     # a MedusaHeads.save_pretrained folder

Keys are `SpeculativeConfig`'s fields; for "medusa", `model` is the heads' folder (loaded here, in `dtype`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..engine.speculative_config import SpeculativeConfig
from ..speculative.medusa_heads import MedusaHeads

EXAMPLE = '{"method": "suffix", "num_speculative_tokens": 5}'


def parse_speculative_config(text: str, dtype: torch.dtype) -> SpeculativeConfig:
    """The `SpeculativeConfig` that `text` (a JSON object) describes; ValueError naming what is wrong (bad JSON, not
    an object, unknown keys with the allowed ones, a value the config refuses, a heads folder that cannot be read)."""
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
        return SpeculativeConfig(**options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--speculative-config: {error}") from None


def _load_heads(path: object, dtype: torch.dtype) -> MedusaHeads:
    if not isinstance(path, str):
        raise ValueError(f"--speculative-config: method 'medusa' needs `model`, the path of a MedusaHeads folder, got "
                         f"{path!r}")
    try:
        return MedusaHeads.from_pretrained(Path(path), dtype=dtype)
    except OSError as error:
        raise ValueError(f"--speculative-config: cannot load Medusa heads from {path!r}: {error}") from None
