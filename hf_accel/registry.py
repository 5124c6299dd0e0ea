"""The one module that patches transformers (and the user's modules): idempotent, reload-safe, reversible.

What `register` changes (all undone by `unregister`):
- `GenerationMixin.generate`: the router given to `register` sees (and may edit) the kwargs first (compiled generate
  claims `compile_config` with the paged cache there); our user-facing names ("paged", "sink") are renamed to internal
  aliases before stock `generate` sees them, so the stock continuous-batching shim does not take over "paged"
  (`model.generate_batch` stays available) and a saved generation config never names a cache that needs hf_accel.
- `GenerationMixin._prepare_cache_for_generation`: our cache names build our caches, and so does the stock name
  "quantized" with `cache_config={"backend": "hf_accel", ...}` (other backends stay stock); for an assistant model
  that already holds a cache, `cache_implementation` is ignored (stock raises "Passing both ..." in round 2).
- `GenerationMixin.generate`, for callable `custom_generate`s: `streamer` is handed to callables that declare
  `hf_accel_streamer`, and `stop_strings` + `tokenizer` become a stopping criterion (stock drops both).
- `GenerationMixin._prefill`: a cache that is a `PrefillHooks` is handed the prompt rows (`input_ids`, the 2-D mask)
  just before and after the prefill forward, so it can fill columns it already holds (a prefix store) and generate
  computes only the rest (it starts at the cache's `get_seq_length()`). Other caches see no change.
- `generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS`: our names are added so validation accepts them.
- `AttentionInterface`: our attention functions (the engine's and compiled generate's paged attention, compiled
  generate's quantized attention) under our own names.
- transformers' quantizer registries: our weight-only methods (`from_pretrained(..., quantization_config=...)`).
The pristine functions and what was registered are kept on the wrappers (never in a module global), so
`importlib.reload` cannot stack them; `PrefillHooks` lives in `prefill_hooks.py`, so a reload keeps the class the
caches subclass.
For the length of a block, never for good: `attention_implementation` switches a model to one of our attention
functions, `instance_forwards` gives modules forwards of hf_accel's (the eager loops' packed Linears; an engine's
steps set theirs with `kernels.linear_panels.LinearPanels`, kept between steps).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, GenerationConfig, StopStringCriteria, StoppingCriteriaList
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin
from transformers.quantizers import register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from .prefill_hooks import PrefillHooks

PAGED_ALIAS = "hf_accel_paged"  # "paged" is intercepted by stock generate; we pass this name through instead
SINK_ALIAS = "hf_accel_sink"
QUANTIZED_ALIAS = "hf_accel_quantized"
USER_NAMES = {"paged": PAGED_ALIAS, "sink": SINK_ALIAS}
QUANTIZED_BACKEND = "hf_accel"  # cache_implementation="quantized" with this cache_config backend is ours
_ORIGINAL_ATTR = "__hf_accel_original__"
_REGISTRATION_ATTR = "__hf_accel_registration__"



@dataclass(frozen=True, slots=True)
class CacheRequest:
    """What generate asks of a cache builder: `num_rows` rows (prompts x max(num_beams, num_return_sequences)) of up
    to `max_cache_len` tokens. `attention_mask` is the prompts' 2-D padding mask `[num_rows, prompt_len]`, one row
    per cache row (None when there is no padding)."""

    generation_config: GenerationConfig
    num_rows: int
    max_cache_len: int
    attention_mask: torch.Tensor | None


# builder(model, request) -> Cache
CacheBuilder = Callable[..., object]


# router(model, generate_kwargs): may edit the kwargs of a generate call before stock generate sees them
GenerateRouter = Callable[[object, dict], None]


@dataclass(frozen=True, slots=True)
class Registration:
    """What `register` added to transformers' registries (kept on the installed `generate` wrapper)."""

    cache_names: tuple[str, ...] = ()
    attention_names: tuple[str, ...] = ()
    quantization_methods: tuple[str, ...] = ()


def register(cache_builders: Mapping[str, CacheBuilder], router: GenerateRouter | None = None,
             attention_functions: Mapping[str, Callable] | None = None,
             quantization_methods: Mapping[str, tuple[type, type]] | None = None) -> None:
    """Install the hooks for `cache_builders` (keyed by internal cache name) and `router`, register
    `attention_functions` (name -> transformers attention function) and `quantization_methods` (name -> (config
    class, quantizer class)). Safe to call again."""
    unregister()
    builders, attention = dict(cache_builders), dict(attention_functions or {})
    methods = dict(quantization_methods or {})
    _install(GenerationMixin, "generate", functools.partial(_wrap_generate, router))
    _install(GenerationMixin, "_prepare_cache_for_generation", functools.partial(_wrap_prepare_cache, builders))
    _install(GenerationMixin, "_prefill", _wrap_prefill)
    configuration_utils.ALL_CACHE_IMPLEMENTATIONS = configuration_utils.ALL_CACHE_IMPLEMENTATIONS + tuple(builders)
    for name, function in attention.items():
        AttentionInterface.register(name, function)
    for method, (config_class, quantizer_class) in methods.items():
        register_quantization_config(method)(config_class)
        register_quantizer(method)(quantizer_class)
    registration = Registration(tuple(builders), tuple(attention), tuple(methods))
    setattr(GenerationMixin.generate, _REGISTRATION_ATTR, registration)


def unregister() -> None:
    """Restore stock transformers exactly. Safe to call when not registered."""
    registration = getattr(GenerationMixin.__dict__.get("generate"), _REGISTRATION_ATTR, Registration())
    configuration_utils.ALL_CACHE_IMPLEMENTATIONS = tuple(
        name for name in configuration_utils.ALL_CACHE_IMPLEMENTATIONS if name not in registration.cache_names
    )
    for name in registration.attention_names:
        AttentionInterface._global_mapping.pop(name, None)
    for method in registration.quantization_methods:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(method, None)
        AUTO_QUANTIZER_MAPPING.pop(method, None)
    for attr in ("generate", "_prepare_cache_for_generation", "_prefill"):
        current = GenerationMixin.__dict__.get(attr)
        if hasattr(current, _ORIGINAL_ATTR):
            setattr(GenerationMixin, attr, getattr(current, _ORIGINAL_ATTR))


def is_registered() -> bool:
    return hasattr(GenerationMixin.__dict__.get("generate"), _ORIGINAL_ATTR)


# model -> [name, its own implementation, how many blocks hold the switch]: the switch is shared, so a thread that
# compiles a model's graphs in the background and the thread that steps it eagerly meanwhile never undo each other's
_SWITCHED: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()
_SWITCH_LOCK = threading.Lock()


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Run `model` (a transformers model) with the registered attention function `name` inside the block, its own
    implementation after the last block that holds the switch ends (nested or in other threads: the Engine switches
    once per run of steps, so single steps pay nothing, and a background compile shares the loop's switch). A block
    asking for another function while one is held raises RuntimeError."""
    with _SWITCH_LOCK:
        held = _SWITCHED.get(model)
        if held is None:
            if model.config._attn_implementation != name:  # (else switched by its owner: nothing to undo)
                if name not in AttentionInterface._global_mapping:
                    raise RuntimeError(f"attention {name!r} is not registered with transformers: hf_accel."
                                       "unregister() was called; call hf_accel.register() to use hf_accel's engine "
                                       "and compiled generate again")
                saved = model.config._attn_implementation
                model.set_attn_implementation(name)
                held = _SWITCHED[model] = [name, saved, 1]
        elif held[0] != name:
            raise RuntimeError(f"the model runs with attention {held[0]!r} in another block; it cannot switch to "
                               f"{name!r} until that block ends")
        else:
            held[2] += 1
    try:
        yield
    finally:
        if held is not None:
            with _SWITCH_LOCK:
                held[2] -= 1
                if held[2] == 0:
                    del _SWITCHED[model]
                    model.set_attn_implementation(held[1])


@contextlib.contextmanager
def instance_forwards(forwards: Iterable[tuple[nn.Module, Callable]]) -> Iterator[int]:
    """Within: each module of `forwards` runs the forward paired with it (set on the instance); yields how many were
    set. `forwards` is consumed inside, so an error part-way (out of memory while packing) still restores those set
    already. After, however the block ends, the forwards this call set are removed (one replaced since is left)."""
    installed: list[tuple[nn.Module, Callable]] = []
    try:
        for module, forward in forwards:
            module.forward = forward
            installed.append((module, forward))
        yield len(installed)
    finally:
        for module, forward in installed:
            if module.__dict__.get("forward") is forward:
                del module.forward


def _install(owner: type, attr: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    original = owner.__dict__[attr]
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _ORIGINAL_ATTR, original)
    setattr(owner, attr, wrapper)


def _wrap_generate(router: GenerateRouter | None, original: Callable) -> Callable:
    def generate(self, *args, **kwargs):
        if router is not None:
            router(self, kwargs)
        name = kwargs.get("cache_implementation")
        if isinstance(name, str) and name in USER_NAMES:
            kwargs["cache_implementation"] = USER_NAMES[name]
        if callable(kwargs.get("custom_generate")):
            _forward_to_custom_generate(kwargs)
        return original(self, *args, **kwargs)

    return generate


def _forward_to_custom_generate(kwargs: dict) -> None:
    """Stock generate drops `streamer` and `tokenizer` for callable `custom_generate`s (so stop strings raise and
    iterator streamers never end). A callable declaring `hf_accel_streamer` gets the streamer under that name and owns
    it (prompt included); `stop_strings` with `tokenizer` become a `StopStringCriteria` in `stopping_criteria`."""
    declared = inspect.signature(kwargs["custom_generate"]).parameters
    if kwargs.get("streamer") is not None and "hf_accel_streamer" in declared:
        kwargs["hf_accel_streamer"] = kwargs.pop("streamer")
    if kwargs.get("stop_strings") and kwargs.get("tokenizer") is not None:
        criterion = StopStringCriteria(kwargs.pop("tokenizer"), kwargs.pop("stop_strings"))
        kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), criterion])


def _wrap_prepare_cache(builders: dict[str, CacheBuilder], original: Callable) -> Callable:
    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        name = internal_cache_name(generation_config.cache_implementation, generation_config.cache_config)
        _check_prefix_store_target(name, generation_config.cache_config)
        has_cache = model_kwargs.get("past_key_values") is not None
        if generation_config.is_assistant and has_cache and name is not None:
            return _without_cache_implementation(original, self, generation_config, model_kwargs,
                                                 generation_mode, batch_size, max_cache_length)
        if name not in builders:
            return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        if has_cache:
            raise ValueError(
                "Passing both `cache_implementation` (used to initialize certain caches) and `past_key_values` "
                "(a Cache object) is unsupported. Please use only one of the two."
            )
        if generation_config.use_cache is False:
            return None
        cache = builders[name](self, _request(generation_config, model_kwargs, batch_size, max_cache_length))
        if generation_config.is_assistant:
            cache.activate_past_recording()
        model_kwargs["past_key_values"] = cache
        return None

    return _prepare_cache_for_generation


def _check_prefix_store_target(name: object, cache_config: object) -> None:
    if isinstance(cache_config, Mapping) and "prefix_store" in cache_config and name != PAGED_ALIAS:
        raise ValueError(f"`cache_config['prefix_store']` needs cache_implementation='paged', got {name!r}")


def _wrap_prefill(original: Callable) -> Callable:
    def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get("past_key_values")
        if not isinstance(cache, PrefillHooks) or model_kwargs.get("inputs_embeds") is not None:
            return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        mask = model_kwargs.get("attention_mask")
        cache.before_prefill(input_ids, mask)
        outputs = original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        cache.after_prefill(input_ids, mask)
        return outputs

    return _prefill


def _request(generation_config, model_kwargs, batch_size: int, max_cache_len: int) -> CacheRequest:
    # generate has already expanded the inputs (and the mask) for beams / num_return_sequences; it drops an all-ones
    # mask, which means no padding
    num_rows = batch_size * max(generation_config.num_beams, generation_config.num_return_sequences)
    mask = model_kwargs.get("attention_mask")
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == num_rows):
        mask = None
    return CacheRequest(generation_config, num_rows, max_cache_len, mask)


def internal_cache_name(cache_implementation: object, cache_config: object) -> object:
    """The name our builders are keyed by for what the user asked (unchanged when it is not ours)."""
    if cache_implementation == "quantized" and isinstance(cache_config, Mapping):
        return QUANTIZED_ALIAS if cache_config.get("backend") == QUANTIZED_BACKEND else cache_implementation
    return USER_NAMES.get(cache_implementation, cache_implementation)


def _without_cache_implementation(original, model, generation_config, *args):
    saved = generation_config.cache_implementation
    generation_config.cache_implementation = None
    try:
        return original(model, generation_config, *args)
    finally:
        generation_config.cache_implementation = saved
