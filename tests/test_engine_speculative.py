"""Speculation in the Engine through `SpeculativeConfig` ("ngram", "suffix", "medusa"): greedy outputs equal the plain
engine's and plain `generate`'s while candidates are really proposed and accepted, rows with and without a match share
steps, sampling stays lossless and within its stop rules, nothing is kept after requests finish or abort, bad
configurations are refused."""

import functools

import pytest
import torch

from conformance import make_model
from engine_helpers import greedy_reference, random_prompts
from hf_accel import Engine, EngineConfig, MedusaHeads, SamplingParams, SpeculativeConfig
from hf_accel.engine.commit import Committer
from hf_accel.engine.model_runner import StepOutput
from hf_accel.engine.outputs import RequestTiming
from hf_accel.engine.scheduler import ScheduledSeq
from hf_accel.engine.sequence import Request, make_sequences


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@functools.lru_cache(maxsize=None)
def tiny() -> torch.nn.Module:
    return make_model("llama", torch.float32, "sdpa")


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose tails repeat (prompt lookup finds matches) and one random prompt."""
    a, b = random_prompts([6, 9], seed=1)
    return [a * 5, b * 3 + a, random_prompts([20], seed=4)[0], b * 2]


def assert_nothing_kept(engine: Engine) -> None:
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.pool.num_used_blocks == 0
    assert engine.core.proposer.num_tracked == 0 and not engine.core.requests


def verifying_every_draft(engine: Engine) -> Engine:
    """`engine` with a model-free proposer whose budget prices a candidate at nothing: every draft is verified, so
    which rounds speculate (and what they accept) does not hang on the machine's timings (a loaded CI machine can make
    measured costs switch speculation off); the costs are still measured from every step."""
    engine.core.proposer.budget.token_cost = 0.0
    return engine


def record_steps(engine: Engine, monkeypatch) -> list[list[int]]:
    """Candidates per scheduled sequence of every step the engine runs."""
    steps: list[list[int]] = []
    execute = engine.core.runner.execute

    def recording(batch):
        steps.append([s.num_drafts for s in batch.scheduled])
        return execute(batch)

    monkeypatch.setattr(engine.core.runner, "execute", recording)
    return steps


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_equals_plain_and_candidates_are_accepted(method, monkeypatch):
    model, prompts = tiny(), repetitive_prompts()
    params = [greedy(20 + 3 * i) for i in range(len(prompts))]
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    engine = verifying_every_draft(Engine(model, config=EngineConfig(block_size=4),
                                          speculative=SpeculativeConfig(method, num_speculative_tokens=6)))
    steps = record_steps(engine, monkeypatch)
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[1].token_ids == greedy_reference(model, prompts[1], params[1].max_tokens)
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0 and 0 < stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens <= 6 * stats.spec_decode_num_drafts
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert stats.num_steps < max(p.max_tokens for p in params)  # accepted candidates saved steps
    # rows with a match and rows without one (0 candidates) ran in the same steps
    assert any(0 in counts and max(counts) > 0 for counts in steps)
    assert_nothing_kept(engine)


def test_the_step_budget_learns_costs_and_acceptance_from_the_steps_that_ran():
    model, prompts = tiny(), repetitive_prompts()
    engine = verifying_every_draft(Engine(model, config=EngineConfig(block_size=4),
                                          speculative=SpeculativeConfig("suffix")))
    steps = []
    observe_step = engine.core.proposer.observe_step

    def recording(batch, out, num_accepted, seconds):
        steps.append((len(batch.scheduled), batch.num_tokens, seconds))
        observe_step(batch, out, num_accepted, seconds)

    engine.core.proposer.observe_step = recording
    engine.generate(prompts, greedy(24))
    assert len(steps) == engine.stats().num_steps and all(seconds > 0 for _, _, seconds in steps)
    budget = engine.core.proposer.budget
    # decode-only steps of 4 rows were timed, plain (4 tokens) and speculating (more) ones alike
    assert budget.cost(4).plain and budget.cost(4).num_speculating > 0
    accepted, expected = budget.evidence["own"]  # decayed sums over the rounds the prompts' own tokens drafted
    assert accepted > 0 and expected > 0
    assert engine.core.proposer._verifying == {}  # nothing kept once every request has finished


def test_suffix_cache_is_shared_across_requests():
    model, prompts = tiny(), repetitive_prompts()
    engine = Engine(model, config=EngineConfig(block_size=4), speculative=SpeculativeConfig("suffix"))
    first = engine.generate(prompts, greedy(16))
    shared = engine.core.proposer.shared
    assert shared.num_sequences == len(prompts) and shared.num_tokens == 16 * len(prompts)
    again = engine.generate(prompts, greedy(16))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    ngram = Engine(model, config=EngineConfig(block_size=4), speculative=SpeculativeConfig("ngram"))
    ngram.generate(prompts, greedy(16))
    assert ngram.core.proposer.shared is None


def test_medusa_through_the_config_equals_plain():
    model = tiny()
    with torch.random.fork_rng():
        torch.manual_seed(3)
        heads = MedusaHeads.for_model(model, num_heads=3, init_from_lm_head=False).eval()
    prompts = random_prompts([5, 23, 9], seed=1)
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, greedy(12))
    config = SpeculativeConfig("medusa", model=heads, num_speculative_tokens=2, max_speculative_batch_tokens=64)
    engine = Engine(model, config=EngineConfig(block_size=4), speculative=config)
    assert [o.token_ids for o in engine.generate(prompts, greedy(12))] == [o.token_ids for o in plain]
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens <= 2 * stats.spec_decode_num_drafts
    assert engine.core.runner.forward.keep_hidden
    assert_nothing_kept(engine)


def test_reference_heads_accept_through_the_config(reference_with_heads):
    model, tokenizer, heads = reference_with_heads
    prompt = tokenizer("def fibonacci(n):\n", add_special_tokens=False)["input_ids"]
    engine = Engine(model, tokenizer, speculative=SpeculativeConfig("medusa", model=heads))
    out = engine.generate([prompt], greedy(24))[0]
    assert out.token_ids == greedy_reference(model, prompt, 24)
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_penalised_greedy_speculates_and_equals_plain():
    """Rows with logits processors verify on their processed scores: a repetition-penalised greedy request speculates
    and still equals the plain engine."""
    model, prompts = tiny(), repetitive_prompts()
    params = greedy(20, repetition_penalty=1.2)
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    engine = verifying_every_draft(Engine(model, config=EngineConfig(block_size=4),
                                          speculative=SpeculativeConfig("ngram")))
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert engine.stats().spec_decode_num_drafts > 0


def test_sampling_speculates_within_max_tokens_and_stops():
    model, prompts = tiny(), repetitive_prompts()
    engine = verifying_every_draft(Engine(model, config=EngineConfig(block_size=4),
                                          speculative=SpeculativeConfig("suffix")))
    stop = 88  # near-greedy sampling below: the tiny random model is nearly uniform at temperature 1
    params = [SamplingParams(max_tokens=10 + i, temperature=0.03, top_k=30, seed=i, n=2, ignore_eos=True,
                             stop_token_ids=[stop]) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    for p, out in zip(params, outputs):
        for sample in out.outputs:
            assert 1 <= len(sample.token_ids) <= p.max_tokens
            assert stop not in sample.token_ids[:-1]
            if sample.finish_reason == "stop":
                assert sample.token_ids[-1] == stop
            else:
                assert sample.finish_reason == "length" and len(sample.token_ids) == p.max_tokens
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    again = verifying_every_draft(Engine(model, config=EngineConfig(block_size=4),
                                         speculative=SpeculativeConfig("suffix"))).generate(prompts, params)
    # seeded: the same draws where the same rounds speculate (a sampled round's draws depend on what it verifies)
    assert [o.outputs[1].token_ids for o in again] == [o.outputs[1].token_ids for o in outputs]
    assert_nothing_kept(engine)


def test_verifying_a_sampled_candidate_is_lossless():
    """The first token a sampled row emits after verifying one deterministic candidate is distributed as the target's
    processed distribution, whichever candidate was proposed."""
    request = Request("r", None, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.9, seed=0), 0,
                      RequestTiming(0.0))
    make_sequences(request, lambda params: None)
    seq = request.sequences[0]
    seq.num_computed_tokens = 2
    logits = torch.tensor([[1.0, 0.5, -0.5, 0.2], [0.3, 0.1, 0.9, -1.0]])  # [last token, candidate] x vocab
    errors = []
    committer = Committer(set(), 64, lambda request, error: errors.append(error))
    target = torch.softmax(logits[0] / 0.9, dim=-1)
    for candidate in (0, 2):
        out = StepOutput(logits, None, [ScheduledSeq(seq, 2, 1, [candidate])], [0])
        counts = torch.zeros(4)
        for _ in range(3000):
            emitted = committer._verify(out)
            assert not errors
            counts[emitted[0][0]] += 1
        assert torch.allclose(counts / counts.sum(), target, atol=0.03), (candidate, counts / counts.sum(), target)


def test_stop_token_inside_an_accepted_chain_is_exact():
    model, prompts = tiny(), repetitive_prompts()
    free = Engine(model, config=EngineConfig(block_size=4)).generate(prompts[:1], greedy(30))[0].token_ids
    engine = verifying_every_draft(Engine(model, config=EngineConfig(block_size=4),
                                          speculative=SpeculativeConfig("ngram")))
    for index in (4, 13, 22):
        token = free[index]
        out = engine.generate(prompts[:1], greedy(30, stop_token_ids=[token]))[0]
        assert out.token_ids == free[: free.index(token) + 1] and out.outputs[0].stop_reason == token
    for max_tokens in (1, 2, 5, 17):
        assert engine.generate(prompts[:1], greedy(max_tokens))[0].token_ids == free[:max_tokens]
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert_nothing_kept(engine)


def test_abort_mid_speculation_frees_everything():
    model, prompts = tiny(), repetitive_prompts()
    engine = Engine(model, config=EngineConfig(block_size=4), speculative=SpeculativeConfig("suffix"))
    finished = []
    ids = [engine.add_request(p, greedy(200), listener=lambda out: out.finished and finished.append(out))
           for p in prompts]
    while engine.stats().spec_decode_num_drafts == 0:
        engine.step()
    assert engine.core.proposer.num_tracked > 0
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    assert len(finished) == len(prompts) and {o.finish_reason for o in finished} == {"abort"}
    assert engine.core.proposer.shared.num_sequences == 0  # aborted outputs are not drafted from
    assert_nothing_kept(engine)


def test_no_speculation_once_the_batch_is_past_the_threshold():
    model, prompts = tiny(), repetitive_prompts()
    engine = Engine(model, config=EngineConfig(block_size=4),
                    speculative=SpeculativeConfig("ngram", max_speculative_batch_tokens=7))
    engine.generate(prompts, greedy(12))  # 4 x (1 + 1) > 7
    assert engine.stats().spec_decode_num_drafts == 0
    engine.generate(prompts[:1], greedy(12))
    assert engine.stats().spec_decode_num_drafts > 0


def test_config_validation():
    heads = MedusaHeads.for_model(tiny(), num_heads=2)
    with pytest.raises(ValueError, match="'ngram', 'suffix', 'medusa', 'eagle3'"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=0)
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=True)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("suffix", prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig("ngram", prompt_lookup_max=0)
    with pytest.raises(ValueError, match="`model` must be None"):
        SpeculativeConfig("ngram", model=heads)
    with pytest.raises(TypeError, match="MedusaHeads"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="at most the heads' 2"):
        SpeculativeConfig("medusa", model=heads, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig("medusa", model=heads, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="max_speculative_batch_tokens"):
        SpeculativeConfig("suffix", max_speculative_batch_tokens=0)
    with pytest.raises(ValueError, match="suffix_decoding_max_cached_requests"):
        SpeculativeConfig("suffix", suffix_decoding_max_cached_requests=0)
    assert SpeculativeConfig("medusa", model=heads).num_candidates == 2
    assert SpeculativeConfig("ngram", prompt_lookup_max=4).ngram_settings().max_depth == 5
