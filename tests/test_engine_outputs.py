"""Output kinds (vLLM's): DELTA reports joined equal the CUMULATIVE output, text and token ids riding together;
FINAL_ONLY reports once; `Engine.stream` and the server share one asyncio bridge (`OutputStream`)."""

from __future__ import annotations

import asyncio

import pytest

from hf_accel import Engine, RequestOutputKind, SamplingParams
from hf_accel.reference import load

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def"]


@pytest.fixture(scope="module")
def target():
    return load("target")


def run(engine: Engine, prompt: str, params: SamplingParams, kind: RequestOutputKind) -> list:
    reports = []
    engine.add_request(prompt, params, listener=reports.append, output_kind=kind)
    while engine.has_unfinished_requests():
        engine.step()
    return reports


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0, logprobs=2),
    SamplingParams(max_tokens=24, temperature=0.9, seed=3, n=2),
    SamplingParams(max_tokens=40, temperature=0, stop=["\n"]),
])
def test_deltas_join_to_the_cumulative_output(target, params):
    model, tokenizer = target
    for prompt in PROMPTS:
        (whole,) = Engine(model, tokenizer).generate([prompt], params)
        deltas = run(Engine(model, tokenizer), prompt, params, RequestOutputKind.DELTA)
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        for sample in whole.outputs:
            parts = [o for d in deltas for o in d.outputs if o.index == sample.index]
            assert "".join(p.text for p in parts) == sample.text
            assert [t for p in parts for t in p.token_ids] == sample.token_ids
            assert [p.finish_reason for p in parts].count(None) == len(parts) - 1
            if sample.logprobs is not None:
                assert [lp for p in parts for lp in p.logprobs] == sample.logprobs
            assert all(p.text for p in parts[:-1])  # token ids ride with their text


def test_final_only_reports_once_and_cumulative_every_step(target):
    model, tokenizer = target
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (final,) = run(Engine(model, tokenizer), PROMPTS[0], params, RequestOutputKind.FINAL_ONLY)
    cumulative = run(Engine(model, tokenizer), PROMPTS[0], params, RequestOutputKind.CUMULATIVE)
    assert len(cumulative) == 12 and [len(c.token_ids) for c in cumulative] == list(range(1, 13))
    assert final.finished and final.token_ids == cumulative[-1].token_ids and final.text == cumulative[-1].text


def test_stream_in_delta_mode_and_early_exit_frees_blocks(target):
    model, tokenizer = target
    engine = Engine(model, tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    (whole,) = engine.generate([PROMPTS[1]], params)

    async def read() -> str:
        text = ""
        async for out in engine.stream(PROMPTS[1], params, output_kind=RequestOutputKind.DELTA):
            text += out.text
        async for _ in engine.stream(PROMPTS[2], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)):
            break  # leaves early: the request is aborted
        for _ in range(200):
            if engine.core.blocks.pool.num_used_blocks == 0:
                break
            await asyncio.sleep(0.01)
        return text

    try:
        assert asyncio.run(read()) == whole.text
    finally:
        engine.shutdown()
    assert engine.core.blocks.pool.num_used_blocks == 0


def test_output_kind_is_checked(target):
    model, tokenizer = target
    with pytest.raises(TypeError, match="`output_kind`"):
        Engine(model, tokenizer).add_request("x", output_kind="delta")
