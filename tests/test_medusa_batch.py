"""medusa_generate at batch size > 1: left-padded rows of different prompt lengths, each accepting its own number of
tokens per step, equal row for row to plain batched greedy `generate` (conformance architectures with full
attention, and the reference target with its committed heads); rows that stop at different steps (EOS, stopping
criteria, stop strings, max_new_tokens) end and are padded exactly as plain `generate` does; scores, logits and
length-dependent processors per row; what batches cannot do is refused by name. Sampling: test_medusa_sampling.py."""

import pytest
import torch
from conformance import PAD, StopOnToken, make_model, make_prompts, make_tokenizer
from test_medusa_generate import CHAIN, WIDE, heads_for
from transformers import StoppingCriteriaList

from hf_accel.speculative.medusa import medusa_generate
from hf_accel.speculative.stats import SpeculativeStats

NEW = 20
LENGTHS = [[5, 12, 9, 3], [11, 4]]


def run(model, inputs, medusa=True, tree=WIDE, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **kwargs}
    if medusa:
        kwargs |= {"custom_generate": medusa_generate, "medusa_heads": heads_for(model), "medusa_tree": tree}
    return model.generate(**inputs, **kwargs)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", torch.float32, "sdpa")


@pytest.mark.parametrize("arch, attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"), ("phi3", "eager")])
def test_greedy_rows_equal_plain_batched_greedy(arch, attn):
    model = make_model(arch, torch.float32, attn)
    wide = SpeculativeStats()
    for seed, lengths in enumerate(LENGTHS):
        inputs = make_prompts(lengths, seed=seed)
        expected = run(model, inputs, medusa=False)
        for name, tree, extra in (("wide", WIDE, {}), ("chain", CHAIN, {}), ("adaptive", None, {}),
                                  ("wide, adaptive", WIDE, {"medusa_adaptive": True})):
            stats = wide if name == "wide" else SpeculativeStats()
            new_before = stats.num_new_tokens
            got = run(model, inputs, tree=tree, medusa_stats=stats, **extra)
            for row in range(len(lengths)):
                assert torch.equal(got[row], expected[row]), f"{arch} {attn} seed {seed} tree {name} row {row}"
            assert stats.num_new_tokens - new_before == NEW * len(lengths)
    # rows accepted different numbers of tokens in the same step (so holes were made and masked)
    assert 0.5 < wide.acceptance_by_position[0] < 1 or 0 < wide.acceptance_by_position[1] < 1, wide


def test_rows_stop_at_different_steps_on_eos(llama):
    inputs = make_prompts([9, 4, 7], seed=5)
    width = inputs["input_ids"].shape[1]
    free = run(llama, inputs, medusa=False)[:, width:]
    eos = int(free[1, 3])  # row 1 stops at step 3 at the latest; others wherever (or never) they emit it
    got = run(llama, inputs, eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
    expected = run(llama, inputs, medusa=False, eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(got.sequences, expected.sequences)
    assert (got.sequences[1, width + free[1].tolist().index(eos) + 1 :] == PAD).all()  # padded after its EOS
    assert_same_per_row(got.scores, expected.scores, got.sequences[:, width:], eos)
    for eos_ids in ([eos, int(free[0, 6])], [int(free[2, 1])]):  # several EOS ids; a row stopping at once
        assert torch.equal(run(llama, inputs, eos_token_id=eos_ids), run(llama, inputs, medusa=False,
                                                                         eos_token_id=eos_ids))


def test_rows_stop_at_different_steps_on_criteria_and_stop_strings(llama):
    inputs = make_prompts([9, 4, 7], seed=9)
    width = inputs["input_ids"].shape[1]
    free = run(llama, inputs, medusa=False)[:, width:]
    tokens = free[torch.arange(3), torch.tensor([5, 2, 8])]
    criteria = lambda: StoppingCriteriaList([StopOnToken(tokens)])  # noqa: E731
    # without EOS, generate extends rows that stopped until the last row stops
    got = run(llama, inputs, stopping_criteria=criteria())
    assert torch.equal(got, run(llama, inputs, medusa=False, stopping_criteria=criteria()))
    assert got.shape[1] < width + NEW
    tokenizer = make_tokenizer()
    stop = [tokenizer.convert_ids_to_tokens(int(free[0, 4])), tokenizer.convert_ids_to_tokens(int(free[2, 6]))]
    kwargs = dict(stop_strings=stop, tokenizer=tokenizer, eos_token_id=PAD + 2)
    assert torch.equal(run(llama, inputs, **kwargs), run(llama, inputs, medusa=False, **kwargs))


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_exact(llama, max_new_tokens):
    inputs = make_prompts([6, 13, 2], seed=3)
    got = run(llama, inputs, max_new_tokens=max_new_tokens)
    assert torch.equal(got, run(llama, inputs, medusa=False, max_new_tokens=max_new_tokens))


def test_length_dependent_processors_see_each_row_as_plain_generate_does(llama):
    # min_new_tokens masks EOS until a row has generated enough; repetition and n-gram rules read each row's history
    inputs = make_prompts([10, 3, 7], seed=6)
    width = inputs["input_ids"].shape[1]
    eos = int(run(llama, inputs, medusa=False)[0, width + 1])
    kwargs = dict(eos_token_id=eos, min_new_tokens=4, repetition_penalty=1.3, no_repeat_ngram_size=2,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    got, expected = run(llama, inputs, **kwargs), run(llama, inputs, medusa=False, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for name in ("scores", "logits"):
        assert_same_per_row(getattr(got, name), getattr(expected, name), got.sequences[:, width:], eos)


def assert_same_per_row(got, expected, generated, eos):
    """Per-step `[batch, vocab]` scores equal for each row up to its EOS (plain generate goes on scoring finished
    rows; medusa_generate returns zeros there, as draft_generate does)."""
    assert len(got) == len(expected) == generated.shape[1]
    for row, tokens in enumerate(generated.tolist()):
        steps = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        for step in range(steps):
            a, b = got[step][row], expected[step][row]
            assert torch.equal(a.isinf(), b.isinf()), (row, step)
            assert torch.allclose(a.masked_fill(a.isinf(), 0), b.masked_fill(b.isinf(), 0), atol=1e-4), (row, step)


def test_num_return_sequences_sampling(llama):
    inputs = make_prompts([8, 3], seed=7)
    torch.manual_seed(0)
    got = run(llama, inputs, do_sample=True, num_return_sequences=3, return_dict_in_generate=True)
    assert got.sequences.shape == (6, 8 + NEW)
    assert torch.equal(got.sequences[:, :8], inputs["input_ids"].repeat_interleave(3, dim=0))
    assert len({tuple(row) for row in got.sequences[:3, 8:].tolist()}) > 1  # rows draw their own tokens


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2"])
def test_sliding_window_models_refused_at_batch_size_above_1(arch):
    model = make_model(arch, torch.float32, "eager")
    with pytest.raises(ValueError, match="batch size > 1.*full-attention"):
        run(model, make_prompts([5, 7], seed=1))
    run(model, make_prompts([5], seed=1), max_new_tokens=2)  # batch size 1 stays supported


def test_reference_target_with_committed_heads_at_batch_4(reference_with_heads):
    from hf_accel import reference

    target, tokenizer, heads = reference_with_heads
    rows = reference.held_out_sequences(tokenizer, seq_len=64, max_rows=4)
    mask = torch.ones_like(rows)
    for row, length in enumerate([64, 40, 23, 51]):  # left-pad to mixed prompt lengths
        mask[row, : 64 - length] = 0
    inputs = {"input_ids": rows.masked_fill(mask == 0, tokenizer.pad_token_id or 0), "attention_mask": mask}
    kwargs = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, eos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id or 0)
    stats = SpeculativeStats()
    got = target.generate(**inputs, custom_generate=medusa_generate, medusa_heads=heads, medusa_stats=stats,
                          medusa_adaptive=False, **kwargs)
    expected = target.generate(**inputs, **kwargs)
    for row in range(4):
        assert torch.equal(got[row], expected[row]), f"row {row}"
    assert stats.tokens_per_forward > 2.0, stats  # the trained heads do get accepted in every row's own walk
