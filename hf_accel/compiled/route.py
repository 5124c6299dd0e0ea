"""Which `generate` calls run hf_accel's compiled loops: `compile_config` with `cache_implementation="paged"` or
`"sink"` (`decode_loop.py`) or hf_accel's `"quantized"` (`quantized_loop.py`), and `ngram_generate` / `draft_generate` /
`eagle_generate` (`speculative_entry.py`) given `compile_config`.

transformers compiles a decode step only for caches that are `is_compileable`, and by default only on accelerators.
With hf_accel's paged cache, `compile_config` selects `decode_loop.compiled_generate` instead, on every device (CPU
included): the hook in `registry.py` sets it as the call's `custom_generate` when nothing else already claims the
decoding (a `custom_generate`, an assistant model, prompt lookup, a cache object passed in).
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from .. import registry

CLAIMS_DECODING = ("custom_generate", "assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit",
                    "past_key_values")


def route_generate(model: Any, kwargs: dict[str, Any]) -> None:
    """Set `kwargs["custom_generate"]` to the compiled loop when the call asks for compilation of hf_accel's paged,
    sink or quantized cache, or to the compiled entry of `ngram_generate` / `draft_generate` / `eagle_generate`
    when it names one of them."""
    config = kwargs.get("generation_config")
    compile_config = setting("compile_config", kwargs, config, model)
    if compile_config is None or setting("disable_compile", kwargs, config, model):
        return
    # the loops load here, on the first call that compiles: `import hf_accel` stays light
    from .decode_loop import compiled_generate
    from .quantized_loop import compiled_quantized_generate
    from .speculative_entry import COMPILED_ENTRIES

    custom = kwargs.get("custom_generate")
    if callable(custom) and custom in COMPILED_ENTRIES:  # the speculative loops: their compiled entries
        kwargs["custom_generate"] = COMPILED_ENTRIES[custom]
        return
    name = registry.internal_cache_name(setting("cache_implementation", kwargs, config, model),
                                        setting("cache_config", kwargs, config, model))
    loops = {registry.PAGED_ALIAS: compiled_generate, registry.SINK_ALIAS: compiled_generate,
             registry.QUANTIZED_ALIAS: compiled_quantized_generate}
    if name in loops and not any(kwargs.get(key) is not None for key in CLAIMS_DECODING):
        kwargs["custom_generate"] = loops[name]


def setting(name: str, kwargs: dict[str, Any], config: GenerationConfig | None, model: Any) -> Any:
    """A generation setting as generate resolves it: the kwarg, else the `generation_config` passed, else the
    model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    if config is not None and getattr(config, name, None) is not None:
        return getattr(config, name)
    return getattr(getattr(model, "generation_config", None), name, None)
