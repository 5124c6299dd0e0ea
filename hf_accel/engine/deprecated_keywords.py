"""`Engine`'s configuration from its arguments: `config=EngineConfig(...)` and `speculative=SpeculativeConfig(...)`,
the one way to configure it, or the keywords it took before them (deprecated, removed in the next release): the
limits (`max_num_seqs`, ..., `enforce_eager`: `EngineConfig`'s fields) and the Medusa shorthand (`medusa_heads` with
`num_speculative_tokens` and `max_speculative_batch_tokens`), made into the configs they stand for with a
`DeprecationWarning` that says what to write instead."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ..speculative.medusa_heads import MedusaHeads
from .config import EngineConfig
from .spec_decode.speculative_config import SpeculativeConfig

LIMIT_KEYWORDS = tuple(field.name for field in dataclasses.fields(EngineConfig))
MEDUSA_KEYWORDS = ("medusa_heads", "num_speculative_tokens", "max_speculative_batch_tokens")


def engine_configs(config: EngineConfig | None, speculative: SpeculativeConfig | None,
                   keywords: dict[str, Any]) -> tuple[EngineConfig, SpeculativeConfig | None]:
    """`config` (default `EngineConfig()`) and `speculative` as given, or the deprecated `keywords` made into them.
    TypeError for an unknown keyword, a config of the wrong type or `config` together with a deprecated keyword;
    ValueError for speculative keywords that do not go together."""
    unknown = [name for name in keywords if name not in LIMIT_KEYWORDS + MEDUSA_KEYWORDS]
    if unknown:
        raise TypeError(f"Engine() got an unexpected keyword argument {unknown[0]!r}")
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"`config` must be a hf_accel.EngineConfig or None, got {type(config).__name__}")
    if speculative is not None and not isinstance(speculative, SpeculativeConfig):
        raise TypeError(f"`speculative` must be a hf_accel.SpeculativeConfig or None, got {type(speculative).__name__}")
    if not keywords:
        return EngineConfig() if config is None else config, speculative
    if config is not None:
        raise TypeError(f"pass either `config` or the deprecated keywords ({', '.join(keywords)}), not both: set "
                        "the limits in the EngineConfig, and Medusa heads as "
                        "speculative=SpeculativeConfig(method='medusa', model=heads)")
    warnings.warn(_what_to_write(keywords), DeprecationWarning, stacklevel=3)
    limits = {name: value for name, value in keywords.items() if name in LIMIT_KEYWORDS}
    return EngineConfig(**limits), _medusa_config(speculative, keywords)


def _what_to_write(keywords: dict[str, Any]) -> str:
    limits = [f"{name}={value!r}" for name, value in keywords.items() if name in LIMIT_KEYWORDS]
    new = [f"config=hf_accel.EngineConfig({', '.join(limits)})"] if limits else []
    if keywords.get("medusa_heads") is not None:
        options = [f"{name}={keywords[name]!r}" for name in MEDUSA_KEYWORDS[1:] if keywords.get(name) is not None]
        fields = ", ".join(["method='medusa'", "model=medusa_heads", *options])
        new.append(f"speculative=hf_accel.SpeculativeConfig({fields})")
    return (f"Engine's keywords {', '.join(keywords)} are deprecated and will be removed in the next release; write "
            f"Engine(model, tokenizer, {', '.join(new)})")


def _medusa_config(speculative: SpeculativeConfig | None, keywords: dict[str, Any]) -> SpeculativeConfig | None:
    """`speculative` as it is, or `medusa_heads` (with the two speculative keywords) as a "medusa" config; ValueError
    when both are given or the speculative keywords come without heads."""
    heads = keywords.get("medusa_heads")
    options = {name: keywords.get(name) for name in MEDUSA_KEYWORDS[1:]}
    if speculative is not None and heads is not None:
        raise ValueError("pass either `speculative` or `medusa_heads`, not both (`medusa_heads=h` is "
                         "`speculative=SpeculativeConfig(method='medusa', model=h)`)")
    if heads is None:
        for name, value in options.items():
            if value is not None:
                raise ValueError(f"`{name}` goes with `medusa_heads`; with `speculative`, set it in the "
                                 "SpeculativeConfig")
        return speculative
    if not isinstance(heads, MedusaHeads):
        raise TypeError(f"`medusa_heads` must be a hf_accel.MedusaHeads, got {type(heads).__name__}")
    return SpeculativeConfig("medusa", options["num_speculative_tokens"], heads,
                             max_speculative_batch_tokens=options["max_speculative_batch_tokens"])
