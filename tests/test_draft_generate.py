"""`hf_accel.draft_generate`: greedy output equals plain greedy `generate` token for token (batch 1 and left-padded
batches whose rows accept different numbers of drafts, on DynamicCache and hf_accel's caches), stopping is exact,
bad input is refused by name. Sampling is tested in test_draft_sampling.py."""

import threading

import pytest
import torch
import transformers
from conformance import (
    PAD, StopOnToken, make_draft_model, make_model, make_prompts, make_tokenizer,
)
from transformers import DynamicCache, TextIteratorStreamer

import hf_accel
from hf_accel import PagedCache, QuantizedKVCache, SpeculativeStats, bench, draft_generate, reference

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


def _pair(arch="llama", attn="sdpa"):
    model = make_model(arch, torch.float32, attn)
    return model, make_draft_model(model)


def _plain(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    return model.generate(**inputs, pad_token_id=PAD, do_sample=False, **kwargs)


def _speculative(model, draft, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    return model.generate(**inputs, pad_token_id=PAD, do_sample=False, custom_generate=draft_generate,
                          draft_model=draft, **kwargs)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("lengths", BATCHES.values(), ids=BATCHES)
def test_greedy_equals_plain_greedy(lengths, cache):
    model, draft = _pair()
    kwargs, cache_type = CACHES[cache]
    stats = SpeculativeStats()
    for seed in (1, 2):
        inputs = make_prompts(lengths, seed=seed)
        expected = _plain(model, inputs, **kwargs)
        out = _speculative(model, draft, inputs, return_dict_in_generate=True, draft_stats=stats, **kwargs)
        assert type(out.past_key_values) is cache_type
        assert torch.equal(out.sequences, expected), f"seed {seed}"
    assert 0 < stats.acceptance_rate < 1 and stats.tokens_per_forward > 1  # partial acceptance was exercised
    if len(lengths) > 1:
        assert len(set(stats.draft_lengths)) > 1  # the draft length adapted


@pytest.mark.parametrize("arch,attn", [("qwen3", "eager"), ("mistral", "sdpa"), ("gemma2", "eager")])
def test_greedy_equals_plain_greedy_batch_1_other_architectures(arch, attn):
    model, draft = _pair(arch, attn)
    inputs = make_prompts([12], seed=3)
    assert torch.equal(_speculative(model, draft, inputs), _plain(model, inputs))


def test_quantized_cache_that_quantizes_runs_and_keeps_the_cache():
    model, draft = _pair()
    config = {"backend": "hf_accel", "nbits": 8, "group_size": 8, "residual_length": 8}
    inputs = make_prompts([5, 12], seed=4)
    out = _speculative(model, draft, inputs, cache_implementation="quantized", cache_config=config,
                       return_dict_in_generate=True)
    expected = _plain(model, inputs, cache_implementation="quantized", cache_config=config)
    assert type(out.past_key_values) is QuantizedKVCache and out.sequences.shape == expected.shape
    assert (out.sequences[:, -NEW:] == expected[:, -NEW:]).float().mean() > 0.5  # int8: nearly always the same


def test_logits_processors_are_applied_to_every_position():
    model, draft = _pair()
    inputs = make_prompts([5, 12, 9], seed=5)
    kwargs = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}
    assert torch.equal(_speculative(model, draft, inputs, **kwargs), _plain(model, inputs, **kwargs))


def test_scores_and_logits_match_plain_generate():
    model, draft = _pair()
    inputs = make_prompts([7, 11], seed=6)
    kwargs = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    expected, out = _plain(model, inputs, **kwargs), _speculative(model, draft, inputs, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == NEW
        for a, b in zip(getattr(expected, name), getattr(out, name)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_custom_stopping_criteria_stop_each_row_exactly():
    model, draft = _pair()
    inputs = make_prompts([9, 4, 7], seed=9)
    free = _plain(model, inputs)[:, -NEW:]
    tokens = free[torch.arange(3), torch.tensor([5, 2, 8])]
    criteria = transformers.StoppingCriteriaList([StopOnToken(tokens)])
    expected = _plain(model, inputs, stopping_criteria=criteria)
    assert expected.shape[1] < inputs["input_ids"].shape[1] + NEW  # the criteria did stop generation
    assert torch.equal(_speculative(model, draft, inputs, stopping_criteria=criteria), expected)


def test_eos_per_row_and_max_new_tokens():
    model, draft = _pair()
    inputs = make_prompts([5, 12, 9, 3], seed=1)
    free = _plain(model, inputs)[:, -NEW:]
    eos = int(free[1, 3])  # row 1 stops at its 4th token; other rows at their first eos, if any
    expected = _plain(model, inputs, eos_token_id=eos, max_new_tokens=NEW - 3)
    got = _speculative(model, draft, inputs, eos_token_id=eos, max_new_tokens=NEW - 3)
    assert torch.equal(got, expected) and got.shape[1] <= inputs["input_ids"].shape[1] + NEW - 3
    assert (got[1, inputs["input_ids"].shape[1] + 4 :] == PAD).all()


def test_stop_strings_and_streamer_batch_1():
    model, draft, tokenizer = *_pair(), make_tokenizer()
    inputs = make_prompts([10], seed=8)
    free = _plain(model, inputs)[0, -NEW:].tolist()
    stop = tokenizer.convert_ids_to_tokens(free[6])
    expected = _plain(model, inputs, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] <= inputs["input_ids"].shape[1] + 7
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=_speculative(
        model, draft, inputs, stop_strings=[stop], tokenizer=tokenizer, streamer=streamer)))
    thread.start()
    chunks = list(streamer)  # ends: draft_generate calls streamer.end()
    thread.join()
    assert torch.equal(result["out"], expected)
    assert "".join(chunks) == tokenizer.decode(expected[0, inputs["input_ids"].shape[1] :])


@pytest.mark.parametrize("kwargs,name", [
    ({"num_beams": 2}, "num_beams"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
    ({"draft_model": None}, "draft_model"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
])
def test_bad_input_is_refused_by_name(kwargs, name):
    model, draft = _pair()
    kwargs = {"draft_model": draft, **kwargs}
    with pytest.raises(ValueError, match=name):
        model.generate(**make_prompts([6]), max_new_tokens=4, pad_token_id=PAD, custom_generate=draft_generate,
                       **kwargs)


def test_sliding_window_batches_and_vocab_mismatch_are_refused():
    model, draft = _pair("mistral")
    with pytest.raises(ValueError, match="sliding_attention"):
        _speculative(model, draft, make_prompts([6, 4]))
    llama = make_model("llama", torch.float32, "sdpa")
    other = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="draft_model"):
        _speculative(llama, other, make_prompts([6]))


@pytest.mark.parametrize("cache_implementation", ["paged", "dynamic"])
def test_stock_assisted_decoding_with_a_cache_implementation(cache_implementation):
    # stock transformers raises "Passing both cache_implementation and past_key_values" in round 2; hf_accel's
    # registry lets the assistant keep the cache it already holds
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([12], seed=5)
    out = model.generate(**inputs, max_new_tokens=NEW, pad_token_id=PAD, do_sample=False,
                         assistant_model=make_draft_model(model), cache_implementation=cache_implementation,
                         return_dict_in_generate=True)
    assert type(out.past_key_values) is (PagedCache if cache_implementation == "paged" else DynamicCache)
    assert torch.equal(out.sequences, _plain(model, inputs))


@pytest.mark.skipif(not reference.has_assets(), reason="reference models not built")
@pytest.mark.parametrize("lengths", [[40], [40, 24, 33]], ids=["batch 1", "left-padded batch 3"])
def test_reference_pair_greedy_equals_plain_greedy(lengths):
    model, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    inputs = bench.text_prompts(tokenizer, lengths)
    stats = SpeculativeStats()
    for kwargs in ({}, {"cache_implementation": "paged"}):
        expected = model.generate(**inputs, max_new_tokens=48, do_sample=False, **kwargs)
        got = model.generate(**inputs, max_new_tokens=48, do_sample=False, custom_generate=draft_generate,
                             draft_model=draft, draft_stats=stats, **kwargs)
        assert torch.equal(got, expected)
    # a trained pair agrees often: tokens per drafting forward (at batch 3 its rounds can cost more than they gain on
    # a CPU, 15 ms for 1.6 tokens against 8 ms plain rounds, and `DraftLength` then decodes plainly after measuring)
    assert 1 + sum(stats.accepted) / stats.proposed[0] > 1.4, stats
