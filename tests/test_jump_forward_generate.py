"""Jump-forward decoding in `generate` (`speculative/jump_forward.py`): a constrained call verifies the tokens its
grammar forces in one forward, on by default. Its greedy output equals constrained decoding without it
(`StructuredOutput(jump_forward=False)`) token for token, batch 1 and left-padded batches, DynamicCache and hf_accel's
paged cache, in fewer target forwards; calls its loop does not cover decode as before; `ngram_generate` drafts forced
tokens too. Sampling is checked in test_structured_generate.py (chi-square)."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TextIteratorStreamer

import hf_accel
from hf_accel import StructuredOutput, reference
from hf_accel.speculative import ngram
from hf_accel.structured import forced_spelling
from hf_accel.structured.forced_spelling import forget_spellings, spellings_forgotten

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"identifier": {"type": "string", "maxLength": 8},
                                           "description": {"enum": ["a red square", "a blue circle"]},
                                           "enabled": {"type": "boolean"}},
          "required": ["identifier", "description", "enabled"], "additionalProperties": False}
PROMPTS = {"batch 1": ["# a config record\nrecord = "],
           "left-padded batch 2": ["record = ", "# the settings of the second service\nconfig = "]}
CACHES = {"dynamic": {}, "paged": {"cache_implementation": "paged", "cache_config": {"block_size": 4}}}


@pytest.fixture(scope="module")
def pair():
    return reference.load("target")


@pytest.fixture
def rounds(monkeypatch) -> list[int]:
    """Counts the jump-forward rounds (calls of the loop's forced-token drafting) while the test runs."""
    calls = []
    original = ngram.with_forced_tokens

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(ngram, "with_forced_tokens", counted)
    return calls


def run(pair, prompts: list[str], constraint: StructuredOutput, **kwargs) -> tuple[list[list[int]], int]:
    """Each row's new tokens (greedy, 96 at most) and how many target forwards the call made."""
    model, tokenizer = pair
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        out = model.generate(**inputs, max_new_tokens=96, do_sample=False, structured_output=constraint,
                             tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id, **kwargs)
    finally:
        hook.remove()
    sequences = out.sequences if hasattr(out, "sequences") else out  # (return_dict_in_generate)
    return sequences[:, inputs["input_ids"].shape[1]:].tolist(), len(forwards)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("batch", PROMPTS)
def test_jump_forward_equals_constrained_decoding_in_fewer_forwards(pair, batch, cache):
    """The schema's keys, the enum's words and the punctuation are forced: verified a round at a time."""
    constraint = StructuredOutput(json=SCHEMA)
    jumped, jumped_forwards = run(pair, PROMPTS[batch], constraint, **CACHES[cache])
    plain, plain_forwards = run(pair, PROMPTS[batch], dataclasses.replace(constraint, jump_forward=False),
                                **CACHES[cache])
    assert jumped == plain
    assert jumped_forwards < plain_forwards, (jumped_forwards, plain_forwards)
    model, tokenizer = pair
    for row in [row for row in jumped if model.generation_config.eos_token_id in row]:  # finished in 96 tokens
        jsonschema.validate(json.loads(tokenizer.decode(row, skip_special_tokens=True)), SCHEMA)


def test_other_constraints_and_a_streamer(pair, rounds):
    """A choice and a regex with forced stretches give the same tokens; a streamer at batch 1 streams them."""
    _, tokenizer = pair
    for constraint in (StructuredOutput(choice=["import collections", "import os"]),
                       StructuredOutput(regex=r"id-(one|two)-[0-9]{2}-end")):
        jumped, _ = run(pair, ["x = 1\n"], constraint)
        assert rounds and jumped == run(pair, ["x = 1\n"], dataclasses.replace(constraint, jump_forward=False))[0]
        rounds.clear()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    [row], _ = run(pair, ["x = 1\n"], StructuredOutput(json=SCHEMA), streamer=streamer)
    assert rounds and "".join(streamer) == tokenizer.decode(row, skip_special_tokens=True)


def test_calls_its_loop_does_not_cover_decode_as_before(pair, rounds):
    """Hidden-state outputs, a static cache, a cache object passed in, settings whose processors read a row's
    history or length, processors of the caller's: stock generate's loop, the same tokens and forwards."""
    model, _ = pair
    constraint = StructuredOutput(json=SCHEMA)
    for kwargs in (lambda: {"output_hidden_states": True, "return_dict_in_generate": True},
                   lambda: {"cache_implementation": "static"},
                   lambda: {"past_key_values": hf_accel.PagedCache(model.config)},  # a new one each call
                   lambda: {"repetition_penalty": 1.3}, lambda: {"min_new_tokens": 30},
                   lambda: {"logits_processor": LogitsProcessorList([TemperatureLogitsWarper(0.5)])}):
        plain = run(pair, PROMPTS["batch 1"], dataclasses.replace(constraint, jump_forward=False), **kwargs())
        assert run(pair, PROMPTS["batch 1"], constraint, **kwargs()) == plain and not rounds, kwargs()


def test_ngram_generate_drafts_forced_tokens(pair):
    """`ngram_generate` under a grammar drafts its forced tokens (source "grammar") where it forces some."""
    constraint = StructuredOutput(json=SCHEMA)
    plain, _ = run(pair, PROMPTS["left-padded batch 2"], dataclasses.replace(constraint, jump_forward=False))
    stats = hf_accel.SpeculativeStats()
    kwargs = {"custom_generate": hf_accel.ngram_generate, "ngram_stats": stats}
    jumped, _ = run(pair, PROMPTS["left-padded batch 2"], constraint, **kwargs)
    assert jumped == plain
    unforced = hf_accel.SpeculativeStats()
    run(pair, PROMPTS["left-padded batch 2"], dataclasses.replace(constraint, jump_forward=False),
        **{**kwargs, "ngram_stats": unforced})
    assert sum(stats.accepted) > sum(unforced.accepted), (stats.accepted, unforced.accepted)


def test_jump_forward_is_a_bool():
    with pytest.raises(TypeError, match="`jump_forward` must be a bool"):
        StructuredOutput(json=SCHEMA, jump_forward="yes")
    assert StructuredOutput(json=SCHEMA).key() == StructuredOutput(json=SCHEMA, jump_forward=False).key()


def test_forced_text_is_drafted_as_the_model_wrote_it_before(pair):
    """The first call learns how the model spells the text the grammar forces (keys, `": "`, brackets); a second
    call with the same schema drafts that spelling, so its forced tokens are kept in fewer forwards, with the same
    output."""
    forget_spellings()  # as in a new process
    schema = {"type": "object", "properties": {"spelling_probe_title": {"type": "string", "maxLength": 6},
                                               "spelling_probe_count": {"type": "integer"}},
              "required": ["spelling_probe_title", "spelling_probe_count"], "additionalProperties": False}
    first, first_forwards = run(pair, PROMPTS["batch 1"], StructuredOutput(json=schema))
    second, second_forwards = run(pair, PROMPTS["batch 1"], StructuredOutput(json=schema))
    plain, _ = run(pair, PROMPTS["batch 1"], StructuredOutput(json=schema, jump_forward=False))
    assert first == second == plain
    assert second_forwards < first_forwards, (second_forwards, first_forwards)


def test_spellings_forgotten_runs_without_the_spellings_and_gives_them_back(pair):
    """Inside `spellings_forgotten` every store starts empty and a call learns into it as a new process would; after
    it, the stores hold exactly what they held before (what was learned inside is gone), and outputs never change."""
    forget_spellings()
    schema = {"type": "object", "properties": {"forgotten_probe_name": {"type": "string", "maxLength": 6},
                                               "forgotten_probe_size": {"type": "integer"}},
              "required": ["forgotten_probe_name", "forgotten_probe_size"], "additionalProperties": False}
    learned, _ = run(pair, PROMPTS["batch 1"], StructuredOutput(json=schema))
    stores = [store for store in forced_spelling._BY_COMPILER.values() if len(store)]
    known = [dict(store._texts) for store in stores]
    assert stores, "the call learned no spelling"
    with spellings_forgotten():
        assert all(len(store) == 0 for store in stores)
        forget_spellings()  # as a benchmark's first-sight run may: still only the block's stores
        fresh, _ = run(pair, PROMPTS["batch 1"], StructuredOutput(json=schema))
        assert any(len(store) for store in stores)  # it learned, into the emptied stores
    assert [dict(store._texts) for store in stores] == known
    again, _ = run(pair, PROMPTS["batch 1"], StructuredOutput(json=schema))
    assert fresh == learned == again
