"""Medusa speculation inside the Engine: greedy outputs equal plain greedy `generate` (tiny random models with
random heads, where nearly every candidate is rejected, and the reference target with its trained heads), stops
exact, prefix cache and preemption correct, sampled requests unaffected, counters plausible, the pool free after."""

import copy
import functools

import pytest
import torch

from conformance import make_model, make_tokenizer
from engine_helpers import assert_greedy_equal, greedy_reference, random_prompts
from hf_accel import Engine, MedusaHeads, SamplingParams, reference
from hf_accel.engine.medusa_proposer import MedusaProposer, accepted_prefix
from hf_accel.engine.scheduler import draft_width
from hf_accel.reference import ASSETS_DIR

LENGTHS = [5, 23, 9, 40, 17, 3, 12, 30]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@functools.lru_cache(maxsize=None)
def tiny_with_heads(arch: str = "llama") -> tuple[torch.nn.Module, MedusaHeads]:
    model = make_model(arch, torch.float32, "sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(3)
        heads = MedusaHeads.for_model(model, num_heads=3, init_from_lm_head=False).eval()
    return model, heads


@functools.lru_cache(maxsize=None)
def reference_with_heads():
    model, tokenizer = reference.load("target")
    heads = MedusaHeads.from_pretrained(ASSETS_DIR / "medusa", dtype=torch.float32)
    return model, tokenizer, heads


def reference_prompts(lengths: list[int]) -> list[list[int]]:
    _, tokenizer, _ = reference_with_heads()
    rows = reference.held_out_sequences(tokenizer, seq_len=64, max_rows=len(lengths))
    return [row[:n].tolist() for row, n in zip(rows, lengths)]


def assert_pool_free(engine: Engine) -> None:
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # every block free, or held only by the prefix cache
    assert blocks.pool.num_used_blocks == blocks.num_cached_blocks


def test_draft_width_rule():
    assert [draft_width(n, 4, 16) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [0, 4, 4, 4, 3, 2, 1, 0]
    assert draft_width(1, 2, 64) == 2  # never more than the heads give


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 1]) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_heads_match_generate(arch):
    """Random heads: nearly every candidate is rejected, so the rollback path runs on every step."""
    model, heads = tiny_with_heads(arch)
    prompts = random_prompts(LENGTHS, seed=1)
    engine = Engine(model, max_num_seqs=8, block_size=4, medusa_heads=heads, max_speculative_batch_tokens=64)
    outputs = engine.generate(prompts, [greedy(6 + i) for i in range(len(prompts))])
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.finish_reason == "length" and len(out.token_ids) == 6 + i
        assert_greedy_equal(model, prompt, out.token_ids, greedy_reference(model, prompt, 6 + i))
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 <= stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pool_free(engine)


def test_reference_heads_match_plain_engine_and_accept():
    model, tokenizer, heads = reference_with_heads()
    prompts = reference_prompts(LENGTHS)
    params = [greedy(24 + 3 * i) for i in range(len(prompts))]
    plain = Engine(model, tokenizer, max_num_seqs=8).generate(prompts, params)
    engine = Engine(model, tokenizer, max_num_seqs=8, medusa_heads=heads, max_speculative_batch_tokens=64)
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].token_ids == greedy_reference(model, prompts[0], 24)
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts > 0.5  # trained heads help
    assert stats.num_steps < sum(p.max_tokens for p in params) / len(params)
    assert_pool_free(engine)


def test_proposer_matches_the_heads():
    model, heads = tiny_with_heads()
    heads = copy.deepcopy(heads)  # the cached heads stay as they are for the other tests
    with torch.no_grad():
        for block in heads.blocks:  # non-zero residual layers, so they matter
            block.layers[0].weight.normal_(std=0.3)
    proposer = MedusaProposer(heads, num_speculative_tokens=2)
    hidden = torch.randn(5, heads.config.hidden_size)
    with torch.no_grad():
        expected = heads(hidden).argmax(dim=-1)[:2].T.tolist()
    assert proposer.propose(hidden, 2) == expected
    assert proposer.propose(hidden, 1) == [row[:1] for row in expected]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        MedusaProposer(heads, num_speculative_tokens=4)
    with pytest.raises(TypeError, match="medusa_heads"):
        Engine(model, medusa_heads=model)
