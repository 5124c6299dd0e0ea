"""The engine's "eagle3" method (`SpeculativeConfig(method="eagle3", model=head)`): greedy outputs equal the plain
engine's while a trained head's drafts are accepted, also with chunked prefills, prefix-cache hits and preemption;
every draft equals the head's prediction recomputed from scratch over the sequence's committed tokens (the proposer's
per-sequence state is exact); sampling stays within its stop rules; the step is compiled; nothing is kept after
requests finish; bad configurations are refused."""

import copy

import pytest
import torch
from test_eagle_generate import model_for, own_text, trained_head

from hf_accel import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from hf_accel.training.eagle_features import target_features
from hf_accel.training.eagle_unroll import unrolled_hidden
from hf_accel.engine.spec_decode.eagle_proposer import EagleProposer
from hf_accel.runtime.dynamo import skip_warm_guards


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompts_of(model, lengths: list[int]) -> list[list[int]]:
    """Beginnings of the model's own text (the head drafts it well), of `lengths` tokens."""
    rows = own_text(model)
    return [rows[i, :n].tolist() for i, n in enumerate(lengths)]


def eagle_engine(model, **limits) -> Engine:
    config = SpeculativeConfig("eagle3", model=trained_head(model), num_speculative_tokens=4,
                               max_speculative_batch_tokens=64)
    return Engine(model, config=EngineConfig(block_size=4, **limits), speculative=config)


def assert_nothing_kept(engine: Engine) -> None:
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.pool.num_used_blocks == 0
    assert engine.core.proposer.num_tracked == 0 and not engine.core.requests


@pytest.mark.compiled
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_plain_and_drafts_are_accepted(arch):
    model = model_for(arch)
    prompts = prompts_of(model, [5, 9, 3, 12])
    params = [greedy(20 + 4 * i) for i in range(len(prompts))]
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    engine = eagle_engine(model)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens > 0.2 * stats.spec_decode_num_draft_tokens  # a trained head
    assert stats.num_steps < max(p.max_tokens for p in params)
    assert engine.core.runner.forward.compiled  # the step returning features is compiled
    assert_nothing_kept(engine)


@pytest.mark.compiled
def test_warm_head_passes_skip_guards_where_the_process_allows(monkeypatch):
    """In a process that allows it (the engine-core process calls `skip_warm_guards(True)`), the warm head's passes
    run under dynamo's distinguishing guards only, as the steps do, with the same tokens."""
    model = model_for("llama")
    prompts, params = prompts_of(model, [5, 9]), [greedy(16), greedy(20)]
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    engine = eagle_engine(model)
    proposer, stances = engine.core.proposer, []
    assert proposer.compiled
    compiled_pass = proposer._step

    def recording(*args):
        stances.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)
        return compiled_pass(*args)

    monkeypatch.setattr(proposer, "_step", recording)
    skip_warm_guards(True)
    try:
        outputs = engine.generate(prompts, params)
    finally:
        skip_warm_guards(False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert stances and all(stances)
    engine.generate(prompts, params)  # an in-process engine (the default) keeps every guard
    assert not any(stances[-3:])


def test_chunked_prefill_prefix_hits_and_preemption_keep_outputs_plain():
    model = model_for("llama")
    prompts = prompts_of(model, [14, 14, 11])
    prompts[1] = prompts[0][:12] + prompts[1][12:]  # shares three full blocks with the first: prefix-cache hits
    params = greedy(24)
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    engine = eagle_engine(model, max_num_batched_tokens=8, max_model_len=40,
                          kv_cache_memory=10 * 4 * 2 * 3 * 2 * 16 * 4)  # 10 blocks (target + head): preemptions
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert_nothing_kept(engine)


def test_each_draft_is_the_heads_prediction_over_the_committed_tokens(monkeypatch):
    model = model_for("llama")
    head = trained_head(model)
    seen = []
    propose = EagleProposer.propose

    def recording(proposer, seqs, num_drafts):
        drafts = propose(proposer, seqs, num_drafts)
        seen.extend((list(seq.token_ids), chain[0]) for seq, chain in zip(seqs, drafts))
        return drafts

    monkeypatch.setattr(EagleProposer, "propose", recording)
    eagle_engine(model).generate(prompts_of(model, [6, 10]), greedy(16))
    assert len(seen) > 6
    for tokens, first in seen:
        ids = torch.tensor([tokens])
        features = target_features(model, ids, head.config.feature_layers)
        with torch.no_grad():
            step0 = unrolled_hidden(model, head, features.hidden.float(), ids, 1)[0]
        assert first == int(head.logits(model, step0[0, -1]).argmax())


def test_sampling_runs_within_its_rules():
    model = model_for("llama")
    engine = eagle_engine(model)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    outputs = engine.generate(prompts_of(model, [7, 9]), params)
    assert all(len(o.token_ids) == 12 for o in outputs)
    again = eagle_engine(model).generate(prompts_of(model, [7, 9]), params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # seeded: reproducible
    assert engine.stats().spec_decode_num_drafts > 0
    assert_nothing_kept(engine)


def test_bad_configurations_are_refused():
    model = model_for("llama")
    with pytest.raises(TypeError, match="`model` must be a hf_accel.EagleHead for method 'eagle3', got NoneType"):
        SpeculativeConfig("eagle3")
    with pytest.raises(ValueError, match="`prompt_lookup_max` is for the methods 'ngram', 'suffix', not 'eagle3'"):
        SpeculativeConfig("eagle3", model=trained_head(model), prompt_lookup_max=3)
    other = copy.deepcopy(trained_head(model))
    other.config.num_target_layers += 1  # a head made for another target
    with pytest.raises(ValueError, match="`eagle_head` was made for"):
        Engine(model, speculative=SpeculativeConfig("eagle3", model=other))
    assert SpeculativeConfig("eagle3", model=trained_head(model)).num_candidates == 3
