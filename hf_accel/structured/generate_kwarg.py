"""`structured_output=` in `model.generate`: the router turns it into a `StructuredLogitsProcessor` in the call's
`logits_processor` (so eager generate, every cache and compiled generate, whose loop applies such processors on the
host between compiled steps, all honour it), with the call's `tokenizer` (required, as for `stop_strings`).

Jump-forward (the constraint's `jump_forward`, on by default): a call `jump_forward_generate` decodes as stock
generate would (`jump_forward_route.py`) runs that loop instead, which verifies the grammar's forced tokens in one
forward (`speculative/jump_forward.py`); so do `ngram_generate` calls."""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig, LogitsProcessorList

from .constraint import StructuredOutput
from .jump_forward_route import takes_jump_forward


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
    from .forced_spelling import spelling_for
    from .grammars import compile_constraint, compiler_for  # xgrammar loads on the first constrained call
    from .logits import StructuredLogitsProcessor

    vocab_size = model.get_output_embeddings().weight.shape[0]
    user_processors = bool(kwargs.get("logits_processor"))
    compiler = compiler_for(tokenizer, vocab_size, _stop_tokens(model, kwargs))
    compiled = compile_constraint(constraint, compiler)
    # learned spellings change the drafts, and with them which draws a seeded sampling call takes: greedy only
    spelling = spelling_for(compiler, compiled) if constraint.jump_forward and not _samples(model, kwargs) else None
    processor = StructuredLogitsProcessor(compiled, constraint.jump_forward, spelling)
    kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])
    if constraint.jump_forward and takes_jump_forward(model, kwargs, user_processors):
        from ..speculative.ngram import jump_forward_generate

        kwargs["custom_generate"] = jump_forward_generate


def _check_decoding(model: Any, kwargs: dict[str, Any]) -> None:
    """ValueError for beam search, whose reordered rows the processor cannot follow (greedy, sampling and every
    speculative method can: the processor follows each row's tokens, rolling back rejected candidates)."""
    config = kwargs.get("generation_config") or model.generation_config
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    if beams > 1:
        raise ValueError(f"`structured_output` supports greedy decoding, sampling and speculative decoding, not "
                         f"beam search (num_beams={beams})")


def _samples(model: Any, kwargs: dict[str, Any]) -> bool:
    config = kwargs.get("generation_config") or model.generation_config
    return bool(kwargs.get("do_sample", getattr(config, "do_sample", False)))


def _stop_tokens(model: Any, kwargs: dict[str, Any]) -> list[int] | None:
    """The call's EOS ids (its `eos_token_id`, else its generation config's), which end a complete grammar."""
    config: GenerationConfig = kwargs.get("generation_config") or model.generation_config
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    if eos is None:
        return None
    return [eos] if isinstance(eos, int) else list(eos)
