"""`hf_accel.ngram_generate`: greedy output equals plain greedy `generate` token for token (batch 1 and left-padded
batches whose rows draft and accept different numbers of tokens, on DynamicCache and hf_accel's caches, several
architectures), stopping is exact, a `SuffixCache` shared across calls drafts from earlier outputs, bad input is
refused by name. Sampling is tested in test_ngram_sampling.py, the drafter in test_suffix_cache.py."""

import threading

import pytest
import torch
import transformers
from conformance import PAD, StopOnToken, make_model, make_prompts, make_tokenizer
from transformers import DynamicCache, TextIteratorStreamer

from hf_accel import (NgramSettings, PagedCache, QuantizedKVCache, SpeculativeStats, SuffixCache, bench, ngram_generate,
                      reference)

NEW = 20
BATCHES = {"batch 1": [12], "left-padded batch 4": [5, 12, 9, 3]}
CACHES = {
    "dynamic": ({}, DynamicCache),
    "paged": ({"cache_implementation": "paged", "cache_config": {"block_size": 4}}, PagedCache),
    "quantized (residual holds all)": (
        {"cache_implementation": "quantized",
         "cache_config": {"backend": "hf_accel", "nbits": 4, "group_size": 16, "residual_length": 64}},
        QuantizedKVCache),
}


def _plain(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    return model.generate(**inputs, pad_token_id=PAD, do_sample=False, **kwargs)


def _ngram(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("draft_token_cost", 0.0)  # verify every draft: the acceptance paths are what is tested
    return model.generate(**inputs, pad_token_id=PAD, do_sample=False, custom_generate=ngram_generate, **kwargs)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("lengths", BATCHES.values(), ids=BATCHES)
def test_greedy_equals_plain_greedy(lengths, cache):
    model = make_model("llama", torch.float32, "sdpa")
    kwargs, cache_type = CACHES[cache]
    stats = SpeculativeStats()
    for seed in (1, 2):
        inputs = make_prompts(lengths, seed=seed, period=4)  # repeating prompts: prompt lookup finds matches
        expected = _plain(model, inputs, **kwargs)
        out = _ngram(model, inputs, return_dict_in_generate=True, ngram_stats=stats, **kwargs)
        assert type(out.past_key_values) is cache_type
        assert torch.equal(out.sequences, expected), f"seed {seed}"
    assert 0 < stats.acceptance_rate < 1 and stats.tokens_per_forward > 1  # partial acceptance was exercised
    assert stats.num_draft_forwards == 0 and len(set(stats.draft_lengths)) > 1  # rows drafted different lengths


@pytest.mark.parametrize("arch,attn", [("qwen3", "eager"), ("mistral", "sdpa"), ("gemma2", "eager"), ("phi3", "sdpa")])
def test_greedy_equals_plain_greedy_batch_1_other_architectures(arch, attn):
    model = make_model(arch, torch.float32, attn)
    inputs = make_prompts([12], seed=3, period=3)
    stats = SpeculativeStats()
    assert torch.equal(_ngram(model, inputs, ngram_stats=stats), _plain(model, inputs))
    assert stats.num_row_rounds < NEW - 1  # some drafts were accepted


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_greedy_equals_plain_greedy_left_padded_batch_other_architectures(arch):
    model = make_model(arch, torch.float32, "sdpa")
    inputs = make_prompts([7, 12, 4], seed=4, period=3)
    assert torch.equal(_ngram(model, inputs), _plain(model, inputs))


def test_logits_processors_are_applied_to_every_position():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([5, 12, 9], seed=5, period=4)
    kwargs = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}
    assert torch.equal(_ngram(model, inputs, **kwargs), _plain(model, inputs, **kwargs))


def test_scores_and_logits_match_plain_generate():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([7, 11], seed=6, period=3)
    kwargs = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    expected, out = _plain(model, inputs, **kwargs), _ngram(model, inputs, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == NEW
        for a, b in zip(getattr(expected, name), getattr(out, name)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_custom_stopping_criteria_stop_each_row_exactly():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([9, 4, 7], seed=9, period=3)
    free = _plain(model, inputs)[:, -NEW:]
    tokens = free[torch.arange(3), torch.tensor([5, 2, 8])]
    criteria = transformers.StoppingCriteriaList([StopOnToken(tokens)])
    expected = _plain(model, inputs, stopping_criteria=criteria)
    assert expected.shape[1] < inputs["input_ids"].shape[1] + NEW  # the criteria did stop generation
    assert torch.equal(_ngram(model, inputs, stopping_criteria=criteria), expected)


def test_eos_per_row_and_max_new_tokens():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([5, 12, 9, 3], seed=1, period=4)
    free = _plain(model, inputs)[:, -NEW:]
    eos = int(free[1, 3])  # row 1 stops at its 4th token; other rows at their first eos, if any
    expected = _plain(model, inputs, eos_token_id=eos, max_new_tokens=NEW - 3)
    got = _ngram(model, inputs, eos_token_id=eos, max_new_tokens=NEW - 3)
    assert torch.equal(got, expected) and got.shape[1] <= inputs["input_ids"].shape[1] + NEW - 3
    assert (got[1, inputs["input_ids"].shape[1] + 4 :] == PAD).all()


def test_stop_strings_and_streamer_batch_1():
    model, tokenizer = make_model("llama", torch.float32, "sdpa"), make_tokenizer()
    inputs = make_prompts([10], seed=8, period=3)
    free = _plain(model, inputs)[0, -NEW:].tolist()
    stop = tokenizer.convert_ids_to_tokens(free[6])
    expected = _plain(model, inputs, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] <= inputs["input_ids"].shape[1] + 7
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=_ngram(
        model, inputs, stop_strings=[stop], tokenizer=tokenizer, streamer=streamer)))
    thread.start()
    chunks = list(streamer)  # ends: ngram_generate calls streamer.end()
    thread.join()
    assert torch.equal(result["out"], expected)
    assert "".join(chunks) == tokenizer.decode(expected[0, inputs["input_ids"].shape[1] :])


def test_a_shared_suffix_cache_drafts_from_the_first_calls_outputs():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([8, 11], seed=11)  # no repeats in the prompts
    cache = SuffixCache()
    first = _ngram(model, inputs, suffix_cache=cache, max_new_tokens=24)
    outputs = [row[inputs["input_ids"].shape[1] :].tolist() for row in first]
    assert cache.num_sequences == 2 and cache.num_tokens == 48
    assert all(cache.count(output[:6]) >= 1 for output in outputs)  # the cache holds the first call's outputs
    results = {}
    for name, shared in (("prompt lookup only", None), ("shared cache", cache)):
        stats = SpeculativeStats()
        again = _ngram(model, inputs, suffix_cache=shared, max_new_tokens=24, ngram_stats=stats)
        assert torch.equal(again, first)
        results[name] = stats
    # the same requests again: the cache knows every continuation after the first token (prompt lookup alone
    # finds only what repeats inside each row)
    assert results["shared cache"].tokens_per_forward > 2 * results["prompt lookup only"].tokens_per_forward
    assert results["shared cache"].acceptance_rate > 0.9


def test_off_switch_stops_drafting_when_nothing_is_accepted():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([12], seed=3, period=3)
    kwargs = {"no_repeat_ngram_size": 2, "max_new_tokens": 40}  # no bigram repeats: every draft from context fails
    stats = SpeculativeStats()
    got = _ngram(model, inputs, draft_token_cost=0.2, ngram_stats=stats, **kwargs)
    assert torch.equal(got, _plain(model, inputs, **kwargs))
    assert stats.acceptance_rate == 0 and sum(stats.draft_lengths) > 0
    assert sum(length > 0 for length in stats.draft_lengths) < 8  # a few failing rounds, then plain steps


@pytest.mark.parametrize("kwargs,error,name", [
    ({"num_beams": 2}, ValueError, "num_beams"),
    ({"output_attentions": True, "return_dict_in_generate": True}, ValueError, "output_attentions"),
    ({"suffix_cache": {}}, TypeError, "suffix_cache"),
    ({"ngram_settings": {"min_probability": 0.2}}, TypeError, "ngram_settings"),
    ({"ngram_stats": 1}, TypeError, "ngram_stats"),
    ({"max_draft_tokens": 0}, ValueError, "max_draft_tokens"),
    ({"max_draft_tokens": 2.0}, TypeError, "max_draft_tokens"),
    ({"draft_token_cost": -1.0}, ValueError, "draft_token_cost"),
])
def test_bad_input_is_refused_by_name(kwargs, error, name):
    model = make_model("llama", torch.float32, "sdpa")
    with pytest.raises(error, match=name):
        model.generate(**make_prompts([6]), max_new_tokens=4, pad_token_id=PAD, custom_generate=ngram_generate,
                       **kwargs)


def test_sliding_window_batches_are_refused():
    model = make_model("mistral", torch.float32, "sdpa")
    with pytest.raises(ValueError, match="sliding_attention"):
        _ngram(model, make_prompts([6, 4]))


def test_settings_change_the_drafts_not_the_output():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([5, 12], seed=2, period=4)
    strict, loose = SpeculativeStats(), SpeculativeStats()
    expected = _plain(model, inputs)
    one = NgramSettings(min_probability=1.0, tokens_per_match=0, extra_tokens=1)  # one certain token per draft
    assert torch.equal(_ngram(model, inputs, ngram_settings=one, ngram_stats=strict), expected)
    assert torch.equal(_ngram(model, inputs, max_draft_tokens=3, ngram_stats=loose), expected)
    assert max(strict.draft_lengths) == 1 and max(loose.draft_lengths) == 3


@pytest.mark.skipif(not reference.has_assets(), reason="reference models not built")
@pytest.mark.parametrize("lengths", [[40], [40, 24, 33]], ids=["batch 1", "left-padded batch 3"])
def test_reference_target_greedy_equals_plain_greedy(lengths):
    model, tokenizer = reference.load("target")
    inputs = bench.text_prompts(tokenizer, lengths)
    stats = SpeculativeStats()
    for kwargs in ({}, {"cache_implementation": "paged"}):
        expected = model.generate(**inputs, max_new_tokens=48, do_sample=False, **kwargs)
        got = model.generate(**inputs, max_new_tokens=48, do_sample=False, custom_generate=ngram_generate,
                             ngram_stats=stats, draft_token_cost=0, **kwargs)  # every draft verified: no timing
        assert torch.equal(got, expected)
    assert stats.tokens_per_forward > 1.1  # the reference target repeats itself
