"""EngineProcess: the engine stepping in its own (spawned) process, driven through the same request API as Engine,
served over HTTP as `hf-accel serve` does by default."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from functools import partial

import httpx
import openai
import pytest
import torch

from hf_accel import Engine, EngineConfig, SamplingParams, StructuredOutputsParams, reference
from hf_accel.engine.engine_process import EngineProcess, EngineProcessError
from hf_accel.engine.errors import ContextLengthExceededError, EngineDeadError
from hf_accel.engine.outputs import RequestOutputKind
from hf_accel.server import create_app, serve_in_thread
from hf_accel.server import command
from hf_accel.server.command import build_parser
from server_helpers import served_app
from hf_accel.server.served_engine import EngineSpec, build_engine

LIMITS = EngineConfig(max_num_seqs=8, max_model_len=256, enforce_eager=True)
SPEC = EngineSpec(None, None, torch.float32, threads=1, config=LIMITS)  # the reference target
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def", "for i in range(10):"]


def spawn(spec: EngineSpec = SPEC) -> EngineProcess:
    return EngineProcess(partial(build_engine, spec), spec.tokenizer(), startup_timeout=600)


@pytest.fixture(scope="module")
def engine():
    process = spawn()
    yield process
    process.shutdown()
    assert not process._process.is_alive()


@pytest.fixture(scope="module")
def in_process():
    model, tokenizer = reference.load("target")
    return Engine(model, tokenizer, config=LIMITS)


def test_greedy_outputs_equal_the_in_process_engine(engine, in_process):
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=9, temperature=0, n=2),
              SamplingParams(max_tokens=30, temperature=0, stop=["\n\n"]), SamplingParams(max_tokens=16, seed=3)]
    got, expected = engine.generate(PROMPTS, params), in_process.generate(PROMPTS, params)
    assert [[o.token_ids for o in out.outputs] for out in got] == [[o.token_ids for o in out.outputs] for out in expected]
    assert [[o.text for o in out.outputs] for out in got] == [[o.text for o in out.outputs] for out in expected]
    assert [out.prompt for out in got] == PROMPTS
    assert engine.stats().num_requests_running == 0 and engine.stats().num_free_blocks == engine.stats().num_blocks


def test_constrained_requests_cross_the_process_boundary(engine, in_process):
    """`structured_outputs` (a Pydantic class, kept as its schema) pickles to the engine-core process, which
    compiles it; a bad one raises in the caller's process."""
    pytest.importorskip("xgrammar")
    import pydantic

    class Pet(pydantic.BaseModel):
        kind: str = pydantic.Field(max_length=10)
        legs: int = pydantic.Field(ge=0, le=8)

    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=StructuredOutputsParams(json=Pet))
    got, expected = engine.generate(["pet = "], params), in_process.generate(["pet = "], params)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    Pet.model_validate_json(got[0].outputs[0].text)
    with pytest.raises(ValueError, match="`structured_outputs`: the `regex` constraint cannot be compiled"):
        engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")))


def test_stream_deltas_add_up_to_the_final_output(engine, in_process):
    params = SamplingParams(max_tokens=20, temperature=0)

    async def collect():
        return [out async for out in engine.stream(PROMPTS[0], params, output_kind=RequestOutputKind.DELTA)]

    deltas = asyncio.run(collect())
    final = in_process.generate([PROMPTS[0]], params)[0].outputs[0]
    assert len(deltas) > 1 and deltas[-1].finished and not deltas[0].finished
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == final.text


def test_bad_input_raises_in_the_callers_process(engine):
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 256"):
        engine.add_request([1] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(TypeError, match="`params` must be a SamplingParams"):
        engine.add_request("hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        engine.add_request([10**9], SamplingParams(max_tokens=3))
    request_id = engine.add_request("x", SamplingParams(max_tokens=200, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", SamplingParams(max_tokens=2), request_id=request_id)
    engine.abort(request_id)


def test_abort_and_a_raising_listener_free_their_blocks(engine):
    finished, done = [], threading.Event()

    def listener(out):
        if out.finished:
            finished.append(out)
            done.set()

    request_id = engine.add_request("def f():", SamplingParams(max_tokens=200, ignore_eos=True), listener=listener)
    engine.abort(request_id)
    assert done.wait(60)
    assert finished[0].outputs[0].finish_reason == "abort"

    def raising(out):
        raise RuntimeError("listener bug")

    engine.add_request("def g():", SamplingParams(max_tokens=200, ignore_eos=True), listener=raising)
    deadline = time.monotonic() + 60
    while engine.stats().num_free_blocks != engine.stats().num_blocks or engine.stats().num_requests_running:
        assert time.monotonic() < deadline, "the raising listener's request was not aborted"
        time.sleep(0.05)
    assert engine.is_healthy


def test_a_listener_may_add_requests_and_ctrl_c_does_not_reach_the_engine(engine):
    os.kill(engine.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    chained, done = [], threading.Event()

    def follow_up(out):
        if out.finished:
            chained.append(out)
            done.set()

    def first(out):
        if out.finished:  # called in the reader thread: adding from here must not block it
            engine.add_request("def g():", SamplingParams(max_tokens=4, temperature=0), listener=follow_up)

    engine.add_request("def f():", SamplingParams(max_tokens=4, temperature=0), listener=first)
    assert done.wait(60) and len(chained[0].outputs[0].token_ids) == 4
    assert engine.is_healthy and engine._process.is_alive()


def test_served_over_http_like_the_in_process_engine(engine, in_process):
    app = create_app(engine, engine.tokenizer, "m")
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        text = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="m", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True) if chunk.choices)
        metrics = httpx.get(f"{url}/metrics").text
        assert httpx.get(f"{url}/health").status_code == 200
    expected = in_process.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert text == streamed == expected
    assert 'hf_accel:request_success_total{finished_reason="length",model_name="m"}' in metrics
    # the app's shutdown stopped the engine-core process
    assert not engine.is_running


def test_a_killed_engine_process_fails_open_requests_and_marks_the_engine_dead():
    engine = spawn()
    try:
        errors, failed = [], threading.Event()

        def listener(out):
            if isinstance(out, BaseException):
                errors.append(out)
                failed.set()

        engine.add_request("def f():", SamplingParams(max_tokens=250, ignore_eos=True), listener=listener)
        os.kill(engine.pid, signal.SIGKILL)
        assert failed.wait(60)
        assert isinstance(errors[0], EngineProcessError) and "exited" in str(errors[0])
        assert not engine.is_healthy and "exited (code -9)" in engine.dead_reason
        with pytest.raises(EngineDeadError):
            engine.add_request("again", SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            engine.generate(["again"])
    finally:
        engine.shutdown(timeout=10)


def test_shutdown_ends_open_requests_and_refuses_new_ones():
    engine = spawn()
    outs, done = [], threading.Event()

    def listener(out):
        outs.append(out)
        if isinstance(out, BaseException) or out.finished:
            done.set()

    engine.add_request("def f():", SamplingParams(max_tokens=250, ignore_eos=True), listener=listener)
    engine.shutdown()
    assert done.wait(10)
    assert isinstance(outs[-1], BaseException) or outs[-1].outputs[0].finish_reason == "abort"
    assert not engine._process.is_alive() and not engine._reader.is_alive() and not engine._writer.is_alive()
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request("again", SamplingParams(max_tokens=2))


def test_an_engine_that_cannot_be_built_raises_with_the_childs_reason(tmp_path):
    spec = EngineSpec(str(tmp_path / "missing"), None, torch.float32, config=LIMITS)
    with pytest.raises(EngineProcessError, match="building the engine in its process failed: .*Error"):
        EngineProcess(partial(build_engine, spec), None, startup_timeout=300)


def test_serve_runs_the_engine_in_its_own_process_by_default(monkeypatch):
    parser = build_parser()
    assert parser.parse_args(["--no-engine-process"]).engine_process is False
    with served_app(monkeypatch, ["--enforce-eager", "--threads", "1", "--max-model-len", "128"]) as app:
        engine = app.state.server.engine
        assert isinstance(engine, EngineProcess) and engine.is_running and engine.pid != os.getpid()
        assert engine.max_model_len == 128 and engine.config.enforce_eager
    assert not engine._process.is_alive()  # shut down with the app
