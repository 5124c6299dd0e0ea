"""Which constrained `generate` calls run `jump_forward_generate` (jump-forward decoding) in place of stock generate's
loop: those it decodes exactly as stock generate would, greedy token for token and sampling in distribution (not
draw for draw: for one seed the draws differ). Its rounds (`ngram_generate`'s) verify several positions in one
forward over ragged rows, calling the logits processors once per verified position, and roll the cache back, so a
call stays with stock generate when:
- something else decodes it: a `custom_generate`, an assistant, prompt lookup, a cache object passed in, or
  `compile_config` (hf_accel's compiled loops);
- its cache cannot roll back exactly (any but the default DynamicCache and "paged"; a paged cache with a prefix store,
  which only stock generate's prefill consults);
- a processor or stopping rule may read a row's length or history, or keep state between calls: processors or
  criteria passed in, `prefix_allowed_tokens_fn`, a negative prompt, and the settings in `STOCK_ONLY_SETTINGS`;
- the loop refuses it: beam search, attention or hidden-state outputs, model inputs besides the ids and mask, a
  streamer over a batch, a batch on a model with sliding-window layers, an encoder-decoder.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.cache_utils import get_layer_types_and_kwargs

from ..compiled.route import CLAIMS_DECODING, setting

JUMP_FORWARD_CACHES = (None, "paged")  # cache_implementation values whose rounds roll back exactly
# generation settings whose processors read a row's length or history, or keep state (classifier-free guidance),
# or that select another decoding mode (contrastive search, DoLa): the call keeps stock generate unless each is at
# GenerationConfig's default
STOCK_ONLY_SETTINGS = ("guidance_scale", "min_length", "min_new_tokens", "repetition_penalty",
                       "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
                       "bad_words_ids", "sequence_bias", "begin_suppress_tokens", "forced_bos_token_id",
                       "forced_eos_token_id", "exponential_decay_length_penalty", "penalty_alpha", "dola_layers",
                       "watermarking_config")
# what `generate` takes besides GenerationConfig fields and model inputs
_GENERATE_ARGUMENTS = frozenset(inspect.signature(GenerationMixin.generate).parameters) | {
    "tokenizer", "assistant_tokenizer", "input_ids", "attention_mask"}
_DEFAULTS = GenerationConfig()


def takes_jump_forward(model: Any, kwargs: dict[str, Any], user_processors: bool) -> bool:
    """Whether the constrained call `kwargs` runs `jump_forward_generate` (see the module docstring);
    `user_processors`: the call passed logits processors of its own."""
    config = kwargs.get("generation_config")

    def given(name: str) -> Any:
        return setting(name, kwargs, config, model)

    if user_processors or any(kwargs.get(key) is not None for key in (
            *CLAIMS_DECODING, "stopping_criteria", "prefix_allowed_tokens_fn", "negative_prompt_ids")):
        return False
    if given("compile_config") is not None or given("use_cache") is False:
        return False
    cache_config = given("cache_config")
    if given("cache_implementation") not in JUMP_FORWARD_CACHES or (
            isinstance(cache_config, dict) and cache_config.get("prefix_store") is not None):
        return False
    if any(given(name) not in (None, getattr(_DEFAULTS, name)) for name in STOCK_ONLY_SETTINGS):
        return False
    return _loop_covers(model, kwargs, given)


def _loop_covers(model: Any, kwargs: dict[str, Any], given: Any) -> bool:
    """The loop's own refusals (`speculative.chain_checks.check_call`), as far as a call's arguments show them."""
    if given("output_attentions") or given("output_hidden_states") or (given("num_beams") or 1) > 1:
        return False
    if model.config.is_encoder_decoder or not model._supports_logits_to_keep():
        return False
    if any(v is not None for k, v in kwargs.items() if k not in _GENERATE_ARGUMENTS and not hasattr(_DEFAULTS, k)):
        return False  # a model input (pixel values, token type ids, ...) or a setting this check does not know
    ids = kwargs.get("input_ids")
    single = isinstance(ids, torch.Tensor) and ids.shape[0] == 1 and (given("num_return_sequences") or 1) == 1
    if kwargs.get("streamer") is not None and not single:
        return False
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return single or all(t == "full_attention" for t in layer_types)
