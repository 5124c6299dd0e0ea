"""`structured_output=` in `model.generate`: the router turns it into a `StructuredLogitsProcessor` in the call's
`logits_processor` (so eager generate, every cache and compiled generate, whose loop applies such processors on the
host between compiled steps, all honour it), with the call's `tokenizer` (required, as for `stop_strings`).

Jump-forward (the constraint's `jump_forward`, on by default): a call that nothing else decodes (no `custom_generate`,
assistant, prompt lookup, cache object or `compile_config`) on a cache whose rounds can be rolled back (the default
DynamicCache, "paged") runs `jump_forward_generate`, which verifies the grammar's forced tokens in one forward
(`speculative/jump_forward.py`); so do `ngram_generate` calls. Calls that loop cannot take (beam search, attention or
hidden-state outputs, model inputs besides the ids and mask, a streamer over a batch, a batch on a model with
sliding-window layers) decode one token at a time, as without it."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.cache_utils import get_layer_types_and_kwargs

from ..compiled.route import CLAIMS_DECODING, setting
from .constraint import StructuredOutput

JUMP_FORWARD_CACHES = (None, "paged")  # cache_implementation values whose rounds roll back exactly


def take_structured_output(model: Any, kwargs: dict[str, Any]) -> None:
    """Pop `structured_output` from generate's `kwargs`, if given, and add its processor to `logits_processor`;
    TypeError / ValueError naming what is wrong with the call."""
    constraint = kwargs.pop("structured_output", None)
    if constraint is None:
        return
    if not isinstance(constraint, StructuredOutput):
        raise TypeError(f"`structured_output` must be a hf_accel.StructuredOutput, got {type(constraint).__name__}")
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("`structured_output` needs the model's tokenizer: pass `tokenizer=tokenizer` to generate")
    _check_decoding(model, kwargs)
    from .grammars import compile_constraint, compiler_for  # xgrammar loads on the first constrained call
    from .logits import StructuredLogitsProcessor

    vocab_size = model.get_output_embeddings().weight.shape[0]
    compiled = compile_constraint(constraint, compiler_for(tokenizer, vocab_size, _stop_tokens(model, kwargs)))
    kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []),
                                                      StructuredLogitsProcessor(compiled, constraint.jump_forward)])
    if constraint.jump_forward and _takes_jump_forward(model, kwargs):
        from ..speculative.ngram import jump_forward_generate

        kwargs["custom_generate"] = jump_forward_generate


def _takes_jump_forward(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether `jump_forward_generate` decodes this call as generate would (see the module docstring)."""
    config = kwargs.get("generation_config")

    def given(name: str) -> Any:
        return setting(name, kwargs, config, model)

    if any(kwargs.get(key) is not None for key in CLAIMS_DECODING) or given("compile_config") is not None:
        return False
    if given("cache_implementation") not in JUMP_FORWARD_CACHES or given("use_cache") is False:
        return False
    if given("output_attentions") or given("output_hidden_states") or (given("num_beams") or 1) > 1:
        return False
    if model.config.is_encoder_decoder or not model._supports_logits_to_keep():
        return False
    if any(isinstance(v, torch.Tensor) for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")):
        return False
    ids = kwargs.get("input_ids")
    single = isinstance(ids, torch.Tensor) and ids.shape[0] == 1 and (given("num_return_sequences") or 1) == 1
    if kwargs.get("streamer") is not None and not single:
        return False
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return single or all(t == "full_attention" for t in layer_types)


def _check_decoding(model: Any, kwargs: dict[str, Any]) -> None:
    """ValueError for beam search, whose reordered rows the processor cannot follow (greedy, sampling and every
    speculative method can: the processor follows each row's tokens, rolling back rejected candidates)."""
    config = kwargs.get("generation_config") or model.generation_config
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    if beams > 1:
        raise ValueError(f"`structured_output` supports greedy decoding, sampling and speculative decoding, not "
                         f"beam search (num_beams={beams})")


def _stop_tokens(model: Any, kwargs: dict[str, Any]) -> list[int] | None:
    """The call's EOS ids (its `eos_token_id`, else its generation config's), which end a complete grammar."""
    config: GenerationConfig = kwargs.get("generation_config") or model.generation_config
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    if eos is None:
        return None
    return [eos] if isinstance(eos, int) else list(eos)
