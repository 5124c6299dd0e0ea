"""The engine's "draft" method (`SpeculativeConfig(method="draft", model=draft_model)`): greedy outputs equal the plain
engine's; a draft that is a copy of the target has every draft accepted, also through chunked prefills, prefix-cache
hits and preemption (the draft's own pool and its per-sequence positions are exact); a draft of another architecture
drafts over the same vocabulary; sampling stays within its rules; the step and the draft are compiled; nothing is
kept after requests finish; bad configurations are refused."""

import copy
import functools

import pytest
import torch
from conformance import VOCAB_SIZE, make_model
from transformers import LlamaConfig, LlamaForCausalLM

from hf_accel import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from hf_accel.engine.spec_decode.draft_proposer import DraftProposer


@functools.lru_cache(maxsize=None)
def peaked_model(seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama with peaked next-token distributions: its own argmax is drafted with confidence."""
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(30)
    return model


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def draft_engine(model, draft, **limits) -> Engine:
    config = SpeculativeConfig("draft", model=draft, num_speculative_tokens=4, max_speculative_batch_tokens=64)
    return Engine(model, config=EngineConfig(block_size=4, **limits), speculative=config)


def assert_nothing_kept(engine: Engine) -> None:
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.pool.num_used_blocks == 0
    assert engine.core.proposer.num_tracked == 0 and not engine.core.requests


def test_a_copy_of_the_target_has_every_draft_accepted():
    model = peaked_model()
    batch = prompts([5, 9, 3, 12])
    params = [greedy(20 + 4 * i) for i in range(len(batch))]
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(batch, params)
    engine = draft_engine(model, copy.deepcopy(model))
    assert [o.token_ids for o in engine.generate(batch, params)] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 40
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert stats.num_steps < max(p.max_tokens for p in params) // 2
    assert_nothing_kept(engine)


def test_chunked_prefill_prefix_hits_and_preemption_keep_drafts_exact():
    model = peaked_model()
    batch = prompts([14, 14, 11], seed=1)
    batch[1] = batch[0][:12] + batch[1][12:]  # shares three full blocks with the first: prefix-cache hits
    params = greedy(24)
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(batch, params)
    per_token = 2 * 2 * 2 * 16 * 4 * 2  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32: target and draft
    engine = draft_engine(model, copy.deepcopy(model), max_num_batched_tokens=8, max_model_len=40,
                          kv_cache_memory=10 * 4 * per_token)  # 10 blocks: preemptions
    assert [o.token_ids for o in engine.generate(batch, params)] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert_nothing_kept(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_draft_of_another_architecture(arch):
    model, draft = make_model(arch, torch.float32, "sdpa"), make_model("qwen3", torch.float32, "sdpa")
    batch = prompts([6, 11, 4], seed=2)
    params = greedy(16)
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(batch, params)
    engine = Engine(model, config=EngineConfig(block_size=4),
                    speculative=SpeculativeConfig("draft", model=draft, max_speculative_batch_tokens=64))
    assert [o.token_ids for o in engine.generate(batch, params)] == [o.token_ids for o in plain]
    assert engine.stats().spec_decode_num_drafts > 0
    assert_nothing_kept(engine)


def test_every_draft_is_the_draft_models_prediction_over_the_committed_tokens(monkeypatch):
    """With a draft that often disagrees with the target (rejections, so written drafts go stale), every chain equals
    the draft model's greedy continuation recomputed from scratch over the sequence's committed tokens, also through
    chunked prefills, prefix-cache hits and preemption."""
    model, draft = peaked_model(), peaked_model(seed=1)  # confident chains, often rejected
    seen = []
    propose = DraftProposer.propose

    def recording(proposer, seqs, num_drafts):
        chains = propose(proposer, seqs, num_drafts)
        seen.extend((list(seq.token_ids), chain) for seq, chain in zip(seqs, chains))
        return chains

    monkeypatch.setattr(DraftProposer, "propose", recording)
    batch = prompts([14, 14, 11], seed=4)
    batch[1] = batch[0][:12] + batch[1][12:]
    per_token = 2 * 2 * 2 * 16 * 4 * 2
    engine = draft_engine(model, draft, max_num_batched_tokens=8, max_model_len=40, kv_cache_memory=10 * 4 * per_token)
    engine.generate(batch, greedy(24))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert len(seen) > 20
    for tokens, chain in seen:
        with torch.no_grad():
            expected = draft.generate(torch.tensor([tokens]), max_new_tokens=len(chain), do_sample=False)
        assert chain == expected[0, len(tokens):].tolist(), (len(tokens), chain)


def test_sampling_runs_within_its_rules():
    model = peaked_model()
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    engine = draft_engine(model, copy.deepcopy(model))
    outputs = engine.generate(prompts([7, 9]), params)
    assert all(len(o.token_ids) == 12 for o in outputs)
    again = draft_engine(model, copy.deepcopy(model)).generate(prompts([7, 9]), params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # seeded: reproducible
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert_nothing_kept(engine)


@pytest.mark.compiled
def test_compiled_step_and_draft():
    model = peaked_model()
    batch = prompts([5, 9])
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(batch, greedy(16))
    engine = draft_engine(model, copy.deepcopy(model))
    assert [o.token_ids for o in engine.generate(batch, greedy(16))] == [o.token_ids for o in plain]
    proposer = engine.core.proposer
    assert engine.core.runner.forward.compiled and proposer.compiled and proposer.compile_seconds > 0
    assert engine.stats().spec_decode_num_accepted_tokens == engine.stats().spec_decode_num_draft_tokens > 0


def test_bad_configurations_are_refused():
    model = peaked_model()
    with pytest.raises(TypeError, match="`model` must be a transformers PreTrainedModel .* for method 'draft'"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="`prompt_lookup_min` is for the methods 'ngram', 'suffix', not 'draft'"):
        SpeculativeConfig("draft", model=model, prompt_lookup_min=2)
    config = LlamaConfig(vocab_size=VOCAB_SIZE + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="draft `model` predicts .* tokens, the served model .*: they must share"):
        Engine(model, speculative=SpeculativeConfig("draft", model=LlamaForCausalLM(config)))
    assert SpeculativeConfig("draft", model=model).num_candidates == 3
    assert SpeculativeConfig("draft", model=model).batch_tokens == 6
