"""What an attacker would send, against the live server on a loopback port: schemathesis over the server's own
OpenAPI schema (bodies that fit it and bodies that do not), and hypothesis bodies built to hurt (NaN, infinities,
huge ints, empty and huge strings, unicode). Rule: an input can fail its own request, never the service: no 5xx
(503 only once the engine is dead, which must not happen; 429 is a full queue), every error in OpenAI's shape, and
afterwards `/health` is 200, the KV pool is whole and a greedy request still gives plain `generate`'s tokens.
Bounded: at most `MAX_EXAMPLES` cases per operation, contexts of `MAX_MODEL_LEN` tokens, a timeout per call."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import greedy_reference
from server_helpers import MODEL_NAME, live_server, load_target, prompt_ids

MAX_EXAMPLES = 40
MAX_MODEL_LEN = 64  # every request is short, whatever max_tokens a case asks for
TIMEOUT = 60.0
FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def target():
    return load_target()


PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def expected(target) -> list[int]:
    """Plain greedy `generate`'s 8 tokens after `PROMPT`, computed before the engine owns the model (while its loop
    runs the model's attention is the engine's)."""
    model, tokenizer = target
    return greedy_reference(model, prompt_ids(tokenizer, PROMPT), 8)


@pytest.fixture(scope="module")
def live(target, expected):
    with live_server(*target, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_queue_len=64) as server:
        yield server
    # what every test of this module leaves behind: a whole pool (shutdown aborted nothing that still ran)
    assert server.engine.core.blocks.pool.num_used_blocks == 0


def assert_answered_alone(response: httpx.Response | schemathesis.Response) -> None:
    """Not a server error; an error body in OpenAI's shape."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error(live, mode):
    # one hypothesis run per operation, driven here rather than by schemathesis' pytest plugin (its collection hook
    # does not run under pytest 9)
    api = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    if mode is schemathesis.GenerationMode.NEGATIVE:  # only what takes input can be given a wrong one
        operations = [op for op in operations if len(op.body) or len(op.query)]
    calls = 0
    for operation in operations:
        @FUZZ_SETTINGS
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case: schemathesis.Case) -> None:
            nonlocal calls
            calls += 1
            assert_answered_alone(case.call(timeout=TIMEOUT))

        call()
    assert calls >= len(operations)
    print(f"schemathesis {mode.value}: {calls} calls over {len(operations)} operations")


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
hostile_numbers = st.one_of(
    st.just(math.nan), st.just(math.inf), st.just(-math.inf), st.integers(-(2**80), 2**80), finite,
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64, 1e-300, 1e300, 0.5]),
)
hostile_strings = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "\ud7ff" * 3, "é" * 200, "x" * 5000]))
sampling_fields = st.fixed_dictionaries({}, optional={
    "temperature": hostile_numbers, "top_p": hostile_numbers, "top_k": hostile_numbers, "min_p": hostile_numbers,
    "repetition_penalty": hostile_numbers, "seed": hostile_numbers, "n": hostile_numbers,
    "max_tokens": st.one_of(hostile_numbers, st.integers(1, 8)), "logprobs": hostile_numbers,
    "priority": hostile_numbers, "stop": st.one_of(hostile_strings, st.lists(hostile_strings, max_size=40)),
    "stop_token_ids": st.lists(hostile_numbers, max_size=8), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "model": st.one_of(st.just(MODEL_NAME), hostile_strings),
})
prompts = st.one_of(hostile_strings, st.lists(st.integers(-5, 2**70), min_size=0, max_size=8),
                    st.lists(hostile_strings, max_size=3))


@FUZZ_SETTINGS
@given(body=sampling_fields, prompt=prompts, chat=st.booleans())
def test_hostile_bodies_fail_alone(live, body, prompt, chat):
    if chat:
        text = prompt if isinstance(prompt, str) else "hi"
        body = {**body, "messages": [{"role": "user", "content": text}]}
        body.pop("logprobs", None)
        path = "/v1/chat/completions"
    else:
        body, path = {**body, "prompt": prompt}, "/v1/completions"
    content = json.dumps(body).encode()  # NaN / Infinity literals, which Python's JSON parser (the server's) reads
    response = httpx.post(f"{live.url}{path}", content=content, timeout=TIMEOUT,
                          headers={"content-type": "application/json"})
    assert_answered_alone(response)


def test_the_server_still_serves_after_the_fuzzing(live, expected):
    assert httpx.get(f"{live.url}/health", timeout=TIMEOUT).status_code == 200
    response = httpx.post(f"{live.url}/v1/completions", timeout=TIMEOUT, json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200
    assert response.json()["choices"][0]["token_ids"] == expected
    stats = live.engine.stats()
    assert stats.num_requests_running == stats.num_requests_waiting == 0
