"""The server answers while its engine loads: `/health` says `loading` (503) until it is built, `compiling` (200)
while eager steps serve and the graphs compile in the background, then `ready` (200); other routes answer 503
`model_loading` until then; an engine that fails to build leaves `failed` (503, with the reason) and calls
`on_load_error`; in an engine-core process the end of a background compile reaches `/health` with no request."""

from __future__ import annotations

import threading
import time
from functools import partial

import httpx
import openai
import pytest
import torch

from hf_accel import Engine, EngineConfig, SamplingParams
from hf_accel.engine.engine_process import EngineProcess
from hf_accel.kernels.custom_ops import paged_attention_kernel
from hf_accel.runtime.step_forward import StepForward
from hf_accel.server import create_app, serve_in_thread
from hf_accel.server.served_engine import EngineSpec, build_engine
from server_helpers import MODEL_NAME, load_target

TIMEOUT = 300.0


def wait_status(url: str, leaving: str) -> dict:
    """`/health`'s body once its status is no longer `leaving`."""
    deadline = time.monotonic() + TIMEOUT
    while (body := httpx.get(f"{url}/health").json()).get("status") == leaving:
        assert time.monotonic() < deadline, f"/health stayed {leaving!r}"
        time.sleep(0.05)
    return body


def complete(url: str, prompt: str, max_tokens: int = 8) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_routes_wait_for_the_engine_while_health_says_loading():
    model, tokenizer = load_target()
    release = threading.Event()

    def build() -> Engine:
        release.wait(TIMEOUT)
        return Engine(model, tokenizer, config=EngineConfig(max_num_seqs=2, max_model_len=128))

    with serve_in_thread(create_app(build, tokenizer, MODEL_NAME)) as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        models = httpx.get(f"{url}/v1/models")
        assert models.status_code == 503 and models.json()["error"]["code"] == "model_loading"
        release.set()
        assert wait_status(url, "loading") == {"status": "ready"}
        assert httpx.get(f"{url}/health").status_code == 200
        expected = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=2, max_model_len=128)).generate(
            "def add(a, b):", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].text
        assert complete(url, "def add(a, b):") == expected


def test_an_engine_that_fails_to_build_leaves_the_server_failed():
    _, tokenizer = load_target()
    failures = []

    def build() -> Engine:
        raise OSError("no weights in ./missing")

    with serve_in_thread(create_app(build, tokenizer, MODEL_NAME, on_load_error=failures.append)) as url:
        body = wait_status(url, "loading")
        assert body == {"status": "failed", "error": "OSError: no weights in ./missing"}
        assert httpx.get(f"{url}/health").status_code == 503
        assert httpx.get(f"{url}/v1/models").json()["error"]["code"] == "model_loading"
    assert [str(error) for error in failures] == ["no weights in ./missing"]


@pytest.mark.compiled
@pytest.mark.skipif(paged_attention_kernel() is None, reason="the paged attention kernel is not built")
def test_health_says_compiling_while_eager_steps_serve(monkeypatch):
    model, tokenizer = load_target()
    expected = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=2, max_model_len=128,
                                                           enforce_eager=True)).generate(
        "import os\n", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].text
    compile_may_end = threading.Event()
    trace = StepForward._trace_graphs

    def held_trace(self, forward, single):  # the compile waits until the test has seen it serve
        compile_may_end.wait(TIMEOUT)
        trace(self, forward, single)

    monkeypatch.setattr(StepForward, "_trace_graphs", held_trace)
    engine = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=2, max_model_len=128,
                                                          compile_in_background=True))
    with serve_in_thread(create_app(engine, tokenizer, MODEL_NAME)) as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and health.json() == {"status": "compiling"}
        assert complete(url, "import os\n") == expected  # served by eager steps
        assert not engine.core.runner.forward.compiled
        compile_may_end.set()
        assert wait_status(url, "compiling") == {"status": "ready"}
        assert complete(url, "import os\n") == expected  # by the graphs
        assert engine.core.runner.forward.compiled


@pytest.mark.compiled
@pytest.mark.skipif(paged_attention_kernel() is None, reason="the paged attention kernel is not built")
def test_an_idle_engine_process_reports_the_end_of_its_compile():
    spec = EngineSpec(None, None, torch.float32, threads=1,
                      config=EngineConfig(max_num_seqs=2, max_model_len=128, compile_in_background=True))
    engine = EngineProcess(partial(build_engine, spec), spec.tokenizer(), startup_timeout=TIMEOUT)
    try:
        assert engine.compiling  # as the child's ready message said
        deadline = time.monotonic() + TIMEOUT
        while engine.compiling:  # no request: the idle child sends its stats when the compile ends
            assert time.monotonic() < deadline and engine.is_healthy, "the compile did not end"
            time.sleep(0.1)
        assert engine.stats().compile_seconds > 0
        out = engine.generate("import os\n", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        model, tokenizer = load_target()
        eager = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=2, max_model_len=128, enforce_eager=True))
        assert out.outputs[0].token_ids == eager.generate(
            "import os\n", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    finally:
        engine.shutdown()
