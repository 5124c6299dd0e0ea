"""Which `generate` calls run hf_accel's compiled loop: `compile_config` with `cache_implementation="paged"`.

transformers compiles a decode step only for caches that are `is_compileable`, and by default only on accelerators.
With hf_accel's paged cache, `compile_config` selects `loop.compiled_generate` instead, on every device (CPU
included): the hook in `registry.py` sets it as the call's `custom_generate` when nothing else already claims the
decoding (a `custom_generate`, an assistant model, prompt lookup, a cache object passed in). The sink and quantized
caches keep host-side state per step (the sink window re-rotates its sink keys every step; quantized K/V repack a
residual window into groups) and have no static layout yet: with `compile_config` they raise rather than quietly
decode eagerly.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from .. import registry
from .loop import compiled_generate

_CLAIMS_DECODING = ("custom_generate", "assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit",
                    "past_key_values")


def route_generate(model: Any, kwargs: dict[str, Any]) -> None:
    """Set `kwargs["custom_generate"]` to the compiled loop when the call asks for compilation of hf_accel's paged
    cache; `ValueError` for compilation with a cache that has no static layout."""
    config = kwargs.get("generation_config")
    compile_config = _setting("compile_config", kwargs, config, model)
    if compile_config is None or _setting("disable_compile", kwargs, config, model):
        return
    name = registry.internal_cache_name(_setting("cache_implementation", kwargs, config, model),
                                        _setting("cache_config", kwargs, config, model))
    if name in (registry.SINK_ALIAS, registry.QUANTIZED_ALIAS):
        user_name = "sink" if name == registry.SINK_ALIAS else "quantized"
        raise ValueError(f"`compile_config` supports cache_implementation='paged' among hf_accel's caches, not "
                         f"{user_name!r}: its per-step host-side bookkeeping has no static layout yet. Drop "
                         "`compile_config` to decode eagerly, or use 'paged' to compile")
    if name == registry.PAGED_ALIAS and not any(kwargs.get(key) is not None for key in _CLAIMS_DECODING):
        kwargs["custom_generate"] = compiled_generate


def _setting(name: str, kwargs: dict[str, Any], config: GenerationConfig | None, model: Any) -> Any:
    """A generation setting as generate resolves it: the kwarg, else the `generation_config` passed, else the
    model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    if config is not None and getattr(config, name, None) is not None:
        return getattr(config, name)
    return getattr(getattr(model, "generation_config", None), name, None)
