"""Engine behaviour with a model: preemption, priorities, prefix caching, streaming, aborts and a dying loop."""

import asyncio
import contextlib

import pytest
import torch

from conformance import make_model
from engine_helpers import HeldSteps, random_prompts
from hf_accel import Engine, EngineConfig, EngineDeadError, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", torch.float32, "sdpa")


def test_preemption_under_a_tiny_pool_changes_no_output(model):
    prompts = random_prompts([20, 9, 14, 30, 5, 11], seed=10)
    roomy = Engine(model, config=EngineConfig(block_size=4, enable_prefix_caching=False)).generate(prompts, GREEDY)
    # 12 blocks of 4 tokens: one sequence of 64 tokens fits, six growing ones do not
    tight = Engine(model, config=EngineConfig(kv_cache_memory=12 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4,
                                              enable_prefix_caching=False, max_model_len=48))
    outputs = tight.generate(prompts, GREEDY)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]
    assert tight.core.blocks.pool.num_used_blocks == 0


def test_seeded_sampling_survives_preemption(model):
    prompts = random_prompts([20, 9, 14, 30], seed=11)
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    roomy = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    tight = Engine(model, config=EngineConfig(kv_cache_memory=12 * 4 * 2 * 2 * 2 * 16 * 4, block_size=4,
                                              max_model_len=48))
    outputs = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]


def test_priorities_are_honoured(model):
    engine = Engine(model, config=EngineConfig(max_num_seqs=1, block_size=4))
    prompts = random_prompts([6, 6, 6], seed=12)
    ids = [engine.add_request(p, SamplingParams(max_tokens=3, temperature=0, priority=pr, ignore_eos=True))
           for p, pr in zip(prompts, [2, 0, 1])]
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == [ids[1], ids[2], ids[0]]


def test_prefix_cache_hits_give_identical_outputs(model):
    header = random_prompts([40], seed=13)[0]
    prompts = [header + tail for tail in random_prompts([3, 7, 5, 9], seed=14)]
    cold = Engine(model, config=EngineConfig(block_size=4, enable_prefix_caching=False)).generate(prompts, GREEDY)
    engine = Engine(model, config=EngineConfig(block_size=4))
    warm = [engine.generate([p], GREEDY)[0] for p in prompts]  # one at a time: later ones hit the header
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert [o.num_cached_tokens for o in warm] == [0, 40, 40, 40]
    stats = engine.stats()
    assert stats.prefix_cache_hits == 120 and stats.prefix_cache_queries == sum(map(len, prompts))


def test_stream_yields_growing_outputs_and_the_same_tokens(model):
    prompt = random_prompts([12], seed=15)[0]
    expected = Engine(model).generate([prompt], GREEDY)[0].token_ids
    engine = Engine(model)

    async def collect():
        return [out async for out in engine.stream(prompt, GREEDY)]

    try:
        updates = asyncio.run(collect())
    finally:
        engine.shutdown()
    assert [len(u.token_ids) for u in updates] == list(range(1, 17))
    assert updates[-1].finished and updates[-1].token_ids == expected


def test_leaving_a_stream_early_aborts_and_frees_blocks(model, monkeypatch):
    engine = Engine(model, config=EngineConfig(block_size=4, enable_prefix_caching=False))
    prompt = random_prompts([12], seed=16)[0]
    steps = HeldSteps(engine, monkeypatch)
    steps.allow(2)  # two tokens, then the engine waits: the request cannot end but by the abort

    async def read_two():
        stream = engine.stream(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        try:
            async with contextlib.aclosing(stream):  # leaving it aborts the request
                async for out in stream:
                    if len(out.token_ids) == 2:
                        break
        finally:
            steps.release()
        for _ in range(200):  # the abort runs at the engine's next step
            if engine.core.blocks.pool.num_used_blocks == 0 and not engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(read_two())
    finally:
        engine.shutdown()
    assert engine.stats().num_requests_running == 0
    assert engine.stats().generation_tokens <= 3  # the two allowed and the step waiting when the stream was left


def test_a_dying_loop_fails_requests_and_turns_unhealthy(model):
    engine = Engine(model)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.core.runner.execute = broken
    engine.start()
    with pytest.raises(EngineDeadError) as error:
        engine.generate([[5, 6, 7]], GREEDY)
    assert isinstance(error.value.__cause__, RuntimeError) and not engine.is_healthy
    with pytest.raises(EngineDeadError):
        engine.add_request([5, 6])
    engine.shutdown()


@pytest.mark.parametrize("bits, group", [(8, None), (4, 32)])
def test_weight_quantized_models_run_in_the_engine(bits, group):
    from tiny_llama import tiny_llama

    from engine_helpers import greedy_reference
    from hf_accel import WeightOnlyConfig, quantize_model

    quantized = quantize_model(tiny_llama(), WeightOnlyConfig(bits=bits, group_size=group))
    prompts = random_prompts([7, 19, 4], seed=17, vocab_size=128)
    outputs = Engine(quantized, config=EngineConfig(block_size=4)).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == greedy_reference(quantized, prompt, 16)


def test_engine_shows_a_one_line_repr_and_an_html_table(model):
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, block_size=4))
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    text = repr(engine)
    assert text.startswith("Engine(model=LlamaForCausalLM, max_num_seqs=4") and "\n" not in text
    assert "generated_tokens=3" in text and "loop=stopped" in text
    html = engine._repr_html_()
    assert html.startswith("<table") and "prefix_hit_rate" in html
