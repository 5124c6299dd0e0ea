"""medusa_generate against plain generate on tiny random models: greedy token for token (DynamicCache and the paged
cache), logits processors, stopping criteria, stop strings, EOS and max_new_tokens exactly, streamers, scores,
seeded sampling, and bad input. Random heads accept little, so most tests use WIDE, a tree holding every token at
depth 1: every step then accepts at least one candidate and the acceptance path is exercised."""

import functools
import threading

import pytest
import torch
from conformance import PAD, VOCAB_SIZE, StopOnToken, make_model, make_prompts, make_tokenizer
from transformers import StoppingCriteriaList, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import hf_accel
from hf_accel.speculative.medusa import medusa_generate
from hf_accel.speculative.stats import SpeculativeStats
from hf_accel.speculative.medusa_heads import MedusaConfig, MedusaHeads
from hf_accel.speculative.tree_size import prefix_sizes

WIDE = [(i,) for i in range(VOCAB_SIZE)] + [(i, j) for i in range(4) for j in range(3)] + [(0, 0, 0), (0, 1, 0)]
CHAIN = [(0,), (0, 0), (0, 0, 0)]
TREES = {"default": None, "wide": WIDE, "chain": CHAIN}
NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return make_model(request.param, torch.float32, "sdpa")


@functools.lru_cache(maxsize=None)
def heads_for(model, num_heads=3):
    with torch.random.fork_rng():  # leaves the global RNG alone for the sampling tests
        torch.manual_seed(0)
        heads = MedusaHeads.for_model(model, num_heads=num_heads)
        with torch.no_grad():  # perturb the residual blocks so heads differ from each other
            for block in heads.blocks:
                block.layers[0].weight.normal_(0, 0.05)
    return heads


def run(model, inputs, medusa=True, tree=WIDE, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **kwargs}
    if medusa:
        kwargs |= {"custom_generate": medusa_generate, "medusa_heads": heads_for(model), "medusa_tree": tree}
    return model.generate(**inputs, **kwargs)


@pytest.mark.parametrize("tree", TREES)
def test_greedy_equals_plain(model, tree):
    for seed in range(3):
        inputs = make_prompts([9 + 3 * seed], seed=seed)
        stats = SpeculativeStats()
        got = run(model, inputs, tree=TREES[tree], medusa_stats=stats)
        assert torch.equal(got, run(model, inputs, medusa=False)), f"prompt {seed}"
        assert stats.num_new_tokens == NEW
    if tree == "wide":  # every step accepts a depth-1 candidate (the last one may stop first)
        assert stats.accepted[0] >= stats.num_target_forwards - 1, stats


@pytest.mark.parametrize("cache_implementation", ["paged", "dynamic"])
def test_cache_kinds_equal_plain(model, cache_implementation):
    inputs = make_prompts([14], seed=5)
    got = run(model, inputs, cache_implementation=cache_implementation, return_dict_in_generate=True)
    expected = hf_accel.PagedCache if cache_implementation == "paged" else transformers_dynamic()
    assert type(got.past_key_values) is expected
    assert torch.equal(got.sequences, run(model, inputs, medusa=False))
    # the cache holds exactly the committed tokens but the last one
    assert got.past_key_values.get_seq_length() == got.sequences.shape[1] - 1


def test_left_padded_single_row(model):
    padded = {name: rows[:1] for name, rows in make_prompts([5, 12], seed=3).items()}  # 7 pads, then 5 tokens
    for kwargs in ({}, {"cache_implementation": "paged"}):
        expected = run(model, padded, medusa=False, **kwargs)
        assert torch.equal(run(model, padded, **kwargs), expected)
        assert torch.equal(run(model, padded, medusa_adaptive=True, **kwargs), expected)  # plain steps, padded


def transformers_dynamic():
    from transformers import DynamicCache

    return DynamicCache


def test_scores_logits_and_processors_match_plain(model):
    inputs = make_prompts([10], seed=6)
    kwargs = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, repetition_penalty=1.3,
                  no_repeat_ngram_size=2)
    got, ref = run(model, inputs, **kwargs), run(model, inputs, medusa=False, **kwargs)
    assert torch.equal(got.sequences, ref.sequences)
    assert len(got.scores) == len(ref.scores) == len(got.logits) == NEW
    for name in ("scores", "logits"):
        for a, b in zip(getattr(got, name), getattr(ref, name)):
            assert torch.allclose(a.masked_fill(a.isinf(), 0), b.masked_fill(b.isinf(), 0), atol=1e-4)
            assert torch.equal(a.isinf(), b.isinf())


@pytest.mark.parametrize("stop_at", [0, 3, 6, 11])
def test_stopping_criteria_exact(model, stop_at):
    inputs = make_prompts([11], seed=7)
    free = run(model, inputs, medusa=False)[0, 11:]
    first = free.tolist().index(int(free[stop_at]))
    criteria = lambda: StoppingCriteriaList([StopOnToken(free[stop_at : stop_at + 1])])  # noqa: E731
    got = run(model, inputs, stopping_criteria=criteria())
    assert torch.equal(got, run(model, inputs, medusa=False, stopping_criteria=criteria()))
    assert got.shape[1] == 11 + first + 1


def test_stop_strings_and_eos_exact(model):
    inputs, tokenizer = make_prompts([10], seed=8), make_tokenizer()
    free = run(model, inputs, medusa=False)[0, 10:].tolist()
    stop = tokenizer.convert_ids_to_tokens(free[5])
    got = run(model, inputs, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(got, run(model, inputs, medusa=False, stop_strings=[stop], tokenizer=tokenizer))
    assert got.shape[1] == 10 + free.index(free[5]) + 1
    got = run(model, inputs, eos_token_id=free[7])
    assert torch.equal(got, run(model, inputs, medusa=False, eos_token_id=free[7]))
    assert got[0, -1] == free[7] and got.shape[1] == 10 + free.index(free[7]) + 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_max_new_tokens_exact(model, max_new_tokens):
    inputs = make_prompts([8], seed=9)
    got = run(model, inputs, max_new_tokens=max_new_tokens)
    assert got.shape[1] == 8 + max_new_tokens
    assert torch.equal(got, run(model, inputs, medusa=False, max_new_tokens=max_new_tokens))


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.num_ends = [], 0

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.num_ends += 1


def test_streamers_get_every_token_and_end(model):
    inputs, tokenizer = make_prompts([10], seed=10), make_tokenizer()
    recording = RecordingStreamer()
    got = run(model, inputs, streamer=recording)
    assert recording.num_ends == 1
    assert recording.chunks[0] == inputs["input_ids"][0].tolist()  # the prompt, once
    assert sum(recording.chunks[1:], []) == got[0, 10:].tolist()  # then each new token
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    thread = threading.Thread(target=lambda: run(model, inputs, streamer=streamer))
    thread.start()
    text = "".join(streamer)  # ends only if end() is called
    thread.join()
    assert text == tokenizer.decode(got[0, 10:])


@pytest.mark.parametrize("adaptive", [False, True])
def test_seeded_sampling_equals_plain_sampling(model, adaptive):
    # one multinomial draw per token on the same distribution, so the same seed gives the same tokens (whatever
    # tree size each step verifies)
    inputs = make_prompts([10], seed=11)
    for seed in range(4):
        outs = []
        for medusa in (True, False):
            torch.manual_seed(seed)
            extra = {"medusa_adaptive": adaptive} if medusa else {}
            outs.append(run(model, inputs, medusa=medusa, do_sample=True, top_k=20, temperature=0.9, **extra))
        assert torch.equal(*outs), f"seed {seed}"


def test_adaptive_tree_sizes(model):
    inputs = make_prompts([9], seed=2)
    fixed, adaptive = SpeculativeStats(), SpeculativeStats()
    run(model, inputs, medusa_stats=fixed)
    assert set(fixed.draft_lengths) == {len(WIDE)}  # an explicit tree is verified whole by default
    got = run(model, inputs, medusa_stats=adaptive, medusa_adaptive=True, max_new_tokens=200)
    assert torch.equal(got, run(model, inputs, medusa=False, max_new_tokens=200))
    sizes = adaptive.draft_lengths
    # whole tree, then a plain step; later sizes depend on wall-clock timings (probes within 2% of the decoding time,
    # tested with given timings in test_tree_size.py), so only the output and the sizes' range are checked here
    assert sizes[:2] == [len(WIDE), 0] and set(sizes) <= set(prefix_sizes(WIDE)), sizes


def test_trees_run_only_the_heads_they_reach(model):
    heads = heads_for(model)  # 3 heads
    calls = [0] * heads.num_heads
    hooks = [head.register_forward_hook(lambda module, args, out, k=k: calls.__setitem__(k, calls[k] + 1))
             for k, head in enumerate(heads.lm_heads)]
    try:
        inputs = make_prompts([9], seed=3)
        stats = SpeculativeStats()
        got = run(model, inputs, tree=[(0,), (1,), (0, 0)], medusa_stats=stats)  # 2 deep: head 2 never runs
        assert torch.equal(got, run(model, inputs, medusa=False))
    finally:
        for hook in hooks:
            hook.remove()
    assert calls[0] == calls[1] == stats.num_target_forwards and calls[2] == 0, calls


def test_bad_input(model):
    inputs = make_prompts([6, 6], seed=12)
    with pytest.raises(ValueError, match="streamer.*batch size 1"):
        run(model, inputs, streamer=RecordingStreamer())
    if model.config.model_type == "qwen2":  # one sliding-window layer: holes would count toward its window
        with pytest.raises(ValueError, match="full-attention"):
            run(model, inputs)
    else:
        with pytest.raises(ValueError, match="past_key_values"):
            run(model, inputs, cache_implementation="paged")
    one = make_prompts([6], seed=12)
    with pytest.raises(ValueError, match="num_beams"):
        run(model, one, num_beams=2)
    with pytest.raises(ValueError, match="medusa_tree"):
        run(model, one, tree=[])
    with pytest.raises(ValueError, match="medusa_tree"):
        run(model, one, tree=[(0, 0)])
    wrong = [MedusaConfig(2, 32, VOCAB_SIZE), MedusaConfig(2, 64, VOCAB_SIZE + 1)]
    for config in wrong:
        with pytest.raises(ValueError, match="medusa_heads"):
            model.generate(**one, max_new_tokens=3, custom_generate=medusa_generate, medusa_heads=MedusaHeads(config))
    with pytest.raises(ValueError, match="medusa_heads"):
        model.generate(**one, max_new_tokens=3, custom_generate=medusa_generate)
    with pytest.raises(ValueError, match="past_key_values"):
        run(model, one, cache_implementation="sink")


@pytest.mark.parametrize("arch, attn", [("mistral", "sdpa"), ("qwen3", "eager"), ("gemma2", "eager"),
                                        ("gemma3", "sdpa"), ("phi3", "sdpa"), ("llama", "eager")])
def test_greedy_equals_plain_across_architectures(arch, attn):
    # sliding-window-only (mistral), hybrid sliding/full (gemma2, gemma3), eager attention (additive mask as is)
    model = make_model(arch, torch.float32, attn)
    inputs = make_prompts([12], seed=4)
    for kwargs in ({}, {"cache_implementation": "paged"}):
        expected = run(model, inputs, medusa=False, **kwargs)
        assert torch.equal(run(model, inputs, **kwargs), expected), kwargs
        # adaptive sizes mix plain one-token steps (the model's own masks) with tree steps on the same cache
        assert torch.equal(run(model, inputs, medusa_adaptive=True, **kwargs), expected), kwargs


def test_reference_target_with_committed_heads(reference_with_heads):
    from hf_accel import reference

    target, tokenizer, heads = reference_with_heads
    prompt = reference.held_out_sequences(tokenizer, seq_len=64, max_rows=1)
    stats = SpeculativeStats()
    kwargs = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False, eos_token_id=None)
    expected = target.generate(prompt, **kwargs)
    assert torch.equal(target.generate(prompt, custom_generate=medusa_generate, medusa_heads=heads, **kwargs), expected)
    # the whole calibrated tree every step (the adaptive default may choose plain steps on a loaded CPU): the trained
    # heads do get accepted (v2 heads: 1.66 tokens per step on this prompt, 1.7-2.7 on the next three)
    got = target.generate(prompt, custom_generate=medusa_generate, medusa_heads=heads, medusa_stats=stats,
                          medusa_adaptive=False, **kwargs)
    assert torch.equal(got, expected)
    assert stats.tokens_per_forward > 1.5, stats
