"""Per-request fault isolation: whatever raises while handling one request fails that request alone (its blocks
back in the pool, finish_reason "error", `RequestOutput.error`), and the engine goes on serving every other request
with outputs identical to plain greedy `generate`. Only faults that concern every request stop the loop, logged once.
Also the up-front checks of `SamplingParams` and the engine's limits, and a hypothesis run of hostile parameters
through the real engine."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance import make_model
from engine_helpers import greedy_reference, random_prompts
from hf_accel import Engine, EngineConfig, EngineDeadError, MedusaHeads, SamplingParams, SpeculativeConfig
from hf_accel.engine import sampler
from hf_accel.engine.detokenizer import Detokenizer, _held_back
from hf_accel.reference import load

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
POISON_TOP_K = 7  # the marker of the request whose sampler raises


@pytest.fixture(scope="module")
def model():
    return make_model("llama", torch.float32, "sdpa")


def assert_pool_whole(engine: Engine) -> None:
    blocks = engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # every block free, or held only by the prefix cache
    assert blocks.pool.num_used_blocks == 0  # cached blocks no sequence uses are free (in the free queue)
    assert not engine.core.requests and not engine.has_unfinished_requests()


@pytest.fixture
def poisoned_sampler(monkeypatch):
    """Logits processors that raise for requests with `top_k == POISON_TOP_K` (a request's own bad processor)."""
    real = sampler.logits_processors

    def processors(params: SamplingParams):
        if params.top_k == POISON_TOP_K:
            raise RuntimeError("this request's logits processor broke")
        return real(params)

    monkeypatch.setattr(sampler, "logits_processors", processors)


@pytest.mark.parametrize("background", [False, True])
def test_a_request_whose_sampler_raises_fails_alone(model, poisoned_sampler, background):
    prompts = random_prompts([5, 17, 9, 30, 3, 12, 21, 8, 14], seed=23)
    poison = SamplingParams(max_tokens=12, temperature=0.8, top_k=POISON_TOP_K, seed=1)
    params = [GREEDY] * 4 + [poison] + [GREEDY] * 4
    engine = Engine(model, config=EngineConfig(max_num_seqs=16, block_size=4))
    if background:
        engine.start()
    try:
        outputs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    failed = outputs[4]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert failed.error.type == "ValueError" and "logits processor broke" in failed.error.message
    assert failed.error.is_client_error  # its own sampling settings could not be applied
    for prompt, out in zip(prompts[:4] + prompts[5:], outputs[:4] + outputs[5:]):
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == greedy_reference(model, prompt, 12)
    assert engine.is_healthy
    assert_pool_whole(engine)


def test_failing_while_creating_samples_fails_alone(model, monkeypatch):
    engine = Engine(model, config=EngineConfig(block_size=4))
    make = engine.core._detokenizer_for

    def detokenizer_for(params):
        if params.max_tokens == 5:
            raise ValueError("`seed` cannot seed a generator")
        return make(params)

    monkeypatch.setattr(engine.core, "_detokenizer_for", detokenizer_for)
    prompts = random_prompts([6, 11], seed=3)
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=5, n=3, temperature=0), GREEDY])
    assert [o.finish_reason for o in outputs[0].outputs] == ["error"] * 3  # every sample reported
    assert outputs[0].error.is_client_error and "`seed`" in outputs[0].error.message
    assert outputs[1].token_ids == greedy_reference(model, prompts[1], 12)
    assert_pool_whole(engine)


class BreakingDetokenizer(Detokenizer):
    """Raises on the fourth token, as a tokenizer meeting bytes it cannot decode would."""

    def add(self, token_id: int) -> str | None:
        if len(self.tokens) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return super().add(token_id)


def test_detokenization_raising_mid_request_fails_it_alone(monkeypatch):
    model, tokenizer = load("target")
    engine = Engine(model, tokenizer, config=EngineConfig(block_size=4))
    make = engine.core._detokenizer_for

    def detokenizer_for(params):
        if params.stop == ["never"]:
            return BreakingDetokenizer(tokenizer, params.stop)
        return make(params)

    monkeypatch.setattr(engine.core, "_detokenizer_for", detokenizer_for)
    prompts = ["def add(a, b):", "import os\n"]
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=8, temperature=0, stop=["never"]), GREEDY])
    assert outputs[0].finish_reason == "error" and len(outputs[0].token_ids) == 4  # the 4th one's text failed
    assert outputs[0].error.type == "UnicodeDecodeError" and outputs[0].error.is_client_error
    assert outputs[1].error is None
    assert outputs[1].token_ids == greedy_reference(model, tokenizer("import os\n")["input_ids"], 12)
    assert_pool_whole(engine)


def test_a_proposer_failing_for_one_sequence_fails_only_its_request(model, monkeypatch):
    with torch.random.fork_rng():
        torch.manual_seed(3)
        heads = MedusaHeads.for_model(model, num_heads=3, init_from_lm_head=False).eval()
    engine = Engine(model, config=EngineConfig(block_size=4),
                    speculative=SpeculativeConfig("medusa", model=heads, max_speculative_batch_tokens=64))
    prompts = random_prompts([5, 23, 9, 17], seed=31)
    victim_prompt = prompts[2]
    real = engine.core.proposer.propose

    def propose(seqs, num_drafts):
        if any(seq.token_ids[: len(victim_prompt)] == victim_prompt for seq in seqs):
            raise RuntimeError("the heads broke on this sequence")
        return real(seqs, num_drafts)

    monkeypatch.setattr(engine.core.proposer, "propose", propose)
    outputs = engine.generate(prompts, GREEDY)
    assert outputs[2].finish_reason == "error" and not outputs[2].error.is_client_error
    for i in (0, 1, 3):
        assert outputs[i].token_ids == greedy_reference(model, prompts[i], 12)
    assert engine.stats().spec_decode_num_drafts > 0  # the others still speculated
    assert_pool_whole(engine)


def test_a_listener_that_raises_aborts_only_its_request(model):
    engine = Engine(model, config=EngineConfig(block_size=4))

    def broken_listener(out):
        raise RuntimeError("the consumer is gone")

    engine.start()
    try:
        engine.add_request(random_prompts([9], seed=5)[0], SamplingParams(max_tokens=50, temperature=0),
                           listener=broken_listener)
        prompt = random_prompts([7], seed=6)[0]
        (out,) = engine.generate([prompt], GREEDY)
    finally:
        engine.shutdown()
    assert out.token_ids == greedy_reference(model, prompt, 12) and engine.is_healthy
    assert_pool_whole(engine)


def test_a_forward_failure_stops_the_loop_and_is_logged_once(model, caplog):
    engine = Engine(model, config=EngineConfig(block_size=4))

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.core.runner.execute = broken
    engine.start()
    with caplog.at_level(logging.ERROR, logger="hf_accel.engine.engine"):
        with pytest.raises(EngineDeadError):
            engine.generate(random_prompts([4, 6], seed=1), GREEDY)
    engine.shutdown()
    records = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(records) == 1 and records[0].exc_info[1].args == ("device lost",)
    assert engine.dead_reason == "RuntimeError: device lost"


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"min_p": -math.inf}, "min_p"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"), ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"seed": 2**63}, "seed"), ({"seed": 2**80}, "seed"), ({"seed": -1}, "seed"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop": "y" * 257}, "stop"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"), ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"), ({"priority": 2**63}, "priority"), ({"n": 0}, "n"),
])
def test_sampling_params_refuse_hostile_values(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=f"`{field}`"):
        SamplingParams(**kwargs)


def test_tiny_temperatures_are_raised_to_vllms_floor():
    assert SamplingParams(temperature=1e-30).temperature == 1e-2
    assert SamplingParams(temperature=0).is_greedy


def test_the_engine_caps_n_and_the_kv_it_may_claim(model):
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, kv_cache_memory=12 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4,
                                               max_model_len=48))  # 12 blocks of 4 tokens
    with pytest.raises(ValueError, match="`n` must be at most max_num_seqs=4"):
        engine.add_request([5, 6], SamplingParams(n=10000))
    with pytest.raises(ValueError, match="exceeds the KV cache's 48 tokens"):
        engine.add_request([5, 6], SamplingParams(n=3, max_tokens=30))  # 3 x 32 tokens
    assert not engine.has_unfinished_requests()


@settings(max_examples=300)
@given(st.text("ab\n", max_size=12), st.lists(st.text("ab\n", min_size=1, max_size=8), max_size=4))
def test_held_back_is_the_longest_tail_that_starts_a_stop(text, stops):
    expected = max((size for stop in stops for size in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:size])), default=0)
    assert _held_back(text, stops) == expected


hostile_numbers = st.one_of(
    st.just(math.nan), st.just(math.inf), st.just(-math.inf), st.integers(-(2**80), 2**80),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0, 1, 2**63 - 1, 2**63, 1e-300, 1e300, 0.5]),
)
# valid but extreme: every value here passes SamplingParams, so the request reaches the sampler and the detokenizer
edge_params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.just(0), st.floats(0, 2), st.sampled_from([1e-30, 1e-3, 1e30, 1e300])),
    "top_p": st.floats(1e-9, 1), "top_k": st.integers(0, 2**80), "min_p": st.floats(0, 1),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), st.sampled_from([1e-300, 1e-30, 1e30, 1e300])),
    "seed": st.integers(0, 2**63 - 1), "n": st.integers(1, 3), "logprobs": st.integers(0, 20),
    "priority": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=20), max_size=16), "stop_token_ids": st.lists(st.integers(0, 2**62)),
    "ignore_eos": st.booleans(),
})
hostile_fields = st.fixed_dictionaries({}, optional={
    name: hostile_numbers for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                       "seed", "n", "logprobs", "priority")
} | {"stop": st.one_of(st.text(max_size=300), st.lists(st.text(max_size=8), max_size=20)),
     "stop_token_ids": st.lists(hostile_numbers, max_size=4)})
hostile_params = st.one_of(edge_params, st.builds(lambda edge, hostile: edge | hostile, edge_params, hostile_fields))


@pytest.fixture(scope="module")
def text_engine():
    model, tokenizer = load("target")
    engine = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=4, block_size=4, max_model_len=48))
    engine.start()
    yield model, tokenizer, engine
    engine.shutdown()


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(kwargs=hostile_params,
       prompt=st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["", "\x00", "é" * 40])))
def test_hostile_parameters_never_stop_the_engine(text_engine, kwargs, prompt):
    model, tokenizer, engine = text_engine
    try:
        params = SamplingParams(**kwargs)
        outputs = engine.generate([prompt], params)
    except (ValueError, TypeError):
        return  # refused up front, naming the argument
    assert outputs[0].finished and engine.is_healthy
    if outputs[0].error is not None:
        assert outputs[0].finish_reason == "error"


def test_the_engine_serves_exactly_after_the_hostile_run(text_engine):
    model, tokenizer, engine = text_engine
    prompt = "def add(a, b):"
    (out,) = engine.generate([prompt], GREEDY)
    engine.shutdown()  # gives the model back its own attention before plain generate runs
    assert out.token_ids == greedy_reference(model, tokenizer(prompt)["input_ids"], 12)
    assert_pool_whole(engine)
