"""Every bad input gets its HTTP status and an OpenAI-shaped error naming the field; API keys; unknown models;
a full queue; a dead engine loop turns /health to 503."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine_helpers import HeldSteps, greedy_reference
from hf_accel import reference
from hf_accel.engine import sampler
from server_helpers import MODEL_NAME, live_server, load_target, prompt_ids

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def target():
    return load_target()


@pytest.fixture(scope="module")
def server(target):
    with live_server(*target, api_key=KEY, max_num_seqs=4) as live:
        yield live


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if param is not None:
        assert f"`{param.split('.')[-1]}`" in error["message"] or f"`{param}`" in error["message"]
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [5000]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -1}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "priority": 1.5}, "priority"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "stream": True, "temperature": -1}, "temperature"),  # 400, not a stream
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": []}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "response_format": {
        "type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[0-9]+"}, "guided_regex"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": "x", "seed": 2**80}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "x", "n": 10000}, "n"),  # at most max_num_seqs
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [0] * 1025}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "priority": 2**70}, "priority"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    assert_error(httpx.post(server.url + path, json=body, headers=AUTH), 400, param)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "seed", "n"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400_naming_the_field(server, field, value):
    for path, base in (("/v1/completions", '"prompt": "x"'), ("/v1/chat/completions", '"messages": [{"role": "user", '
                                                                                      '"content": "hi"}]')):
        content = f'{{{base}, "{field}": {value}}}'.encode()  # literals Python's JSON parser (the server's) reads
        response = httpx.post(server.url + path, content=content, headers={**AUTH, "Content-Type": "application/json"})
        assert_error(response, 400, field)
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("content", [b"{bad json", b"[1, 2]", b""])
def test_malformed_json_is_400(server, content):
    response = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert_error(response, 400, None, "invalid_json")


@pytest.mark.parametrize("path, make_body", [
    ("/v1/completions", lambda limit: {"prompt": "x", "max_tokens": limit}),
    ("/v1/completions", lambda limit: {"prompt": [7] * (limit - 2), "max_tokens": 3}),
    ("/v1/chat/completions", lambda limit: {"messages": CHAT, "max_tokens": limit}),
    ("/v1/chat/completions", lambda limit: {"messages": [{"role": "user", "content": "x " * limit}]}),
])
def test_prompt_plus_max_tokens_beyond_the_context_is_400(server, path, make_body):
    limit = server.engine.max_model_len
    for stream in (False, True):
        response = httpx.post(server.url + path, json={**make_body(limit), "stream": stream}, headers=AUTH)
        error = assert_error(response, 400, "max_tokens", "context_length_exceeded")
        assert f"maximum context length is {limit}" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}),
])
def test_unknown_model_is_404(server, path, body):
    error = assert_error(httpx.post(server.url + path, json=body, headers=AUTH), 404, "model", "model_not_found")
    assert "gpt-9" in error["message"]


def test_api_key_is_required_on_the_api_routes_only(server):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert_error(httpx.post(f"{server.url}/v1/completions", json=body, headers=headers), 401, None,
                     "invalid_api_key")
    assert_error(httpx.get(f"{server.url}/v1/models"), 401, None, "invalid_api_key")
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_unknown_route_is_404_in_openai_shape(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing", headers=AUTH), 404, None)


def test_chat_without_a_usable_chat_template_is_400():
    model, tokenizer = reference.load("target")
    tokenizer.chat_template = None
    with live_server(model, tokenizer, max_num_seqs=1) as live:
        response = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": CHAT})
        assert "chat template" in assert_error(response, 400, "messages", "no_chat_template")["message"]
        tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"  # a template refusing the messages
        response = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": CHAT})
        assert "roles must alternate" in assert_error(response, 400, "messages", "invalid_value")["message"]


def test_full_queue_is_429(target, monkeypatch):
    with live_server(*target, max_num_seqs=1, max_queue_len=1) as live, httpx.Client(timeout=60) as client:
        url = f"{live.url}/v1/completions"
        body = {"prompt": "def main():", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
        steps = HeldSteps(live.engine, monkeypatch)
        steps.allow()  # the first request's prefill and first token; then nothing moves until the 429 is seen
        try:
            with client.stream("POST", url, json=body) as running:
                next(running.iter_lines())  # its first token came: it runs and no longer waits
                with client.stream("POST", url, json=body) as waiting:
                    assert waiting.status_code == 200
                    error = assert_error(client.post(url, json=body), 429, None, "queue_full")
                    assert "max_queue_len=1" in error["message"]
        finally:
            steps.release()
        # both streams closed: room again, once the server has seen the disconnects (it learns them asynchronously)
        deadline = time.monotonic() + 10
        while (ok := client.post(url, json={**body, "stream": False, "max_tokens": 2})).status_code == 429:
            assert time.monotonic() < deadline, "the closed streams never gave their queue slots back"
            time.sleep(0.05)
        assert ok.status_code == 200


def test_health_is_503_once_the_engine_loop_dies():
    model, tokenizer = reference.load("target")
    with live_server(model, tokenizer, max_num_seqs=1) as live:
        assert httpx.get(f"{live.url}/health").status_code == 200

        def broken_forward(*args, **kwargs):
            raise RuntimeError("simulated device failure")

        model.forward = broken_forward
        body = {"prompt": "x", "max_tokens": 2}
        assert_error(httpx.post(f"{live.url}/v1/completions", json=body), 503, None, "engine_dead")
        assert not live.engine.is_healthy
        error = assert_error(httpx.get(f"{live.url}/health"), 503, None, "engine_dead")
        assert "RuntimeError: simulated device failure" in error["message"]
        assert_error(httpx.post(f"{live.url}/v1/completions", json=body), 503, None, "engine_dead")
        assert 'hf_accel:engine_loop_failures_total{model_name="reference-target"} 1.0' in httpx.get(
            f"{live.url}/metrics").text


def test_a_request_whose_sampler_raises_fails_alone_over_http(target, monkeypatch):
    real = sampler.logits_processors

    def processors(params):
        if params.top_k == 7:
            raise RuntimeError("this request's logits processor broke")
        return real(params)

    monkeypatch.setattr(sampler, "logits_processors", processors)
    model, tokenizer = target
    prompts = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(", "x = [", "return", "if x:",
               "while True:"]
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    expected = [greedy_reference(model, prompt_ids(tokenizer, p), 8) for p in prompts]  # before the engine owns it
    with live_server(model, tokenizer, max_num_seqs=16) as live, httpx.Client(timeout=120) as client:
        url = f"{live.url}/v1/completions"
        with ThreadPoolExecutor(9) as pool:
            bad = pool.submit(client.post, url, json={"prompt": "x = 1", "top_k": 7, "max_tokens": 8})
            good = [pool.submit(client.post, url, json={"prompt": p, **greedy}) for p in prompts]
            error = assert_error(bad.result(), 400, None, "request_failed")
            assert "logits processor broke" in error["message"]
            for tokens, response in zip(expected, good):
                assert response.result().status_code == 200
                assert response.result().json()["choices"][0]["token_ids"] == tokens
        with client.stream("POST", url, json={"prompt": "x = 1", "top_k": 7, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_failed"
        assert events[-1] == "data: [DONE]"
        assert client.get(f"{live.url}/health").status_code == 200
        assert 'finished_reason="error"' in client.get(f"{live.url}/metrics").text
        blocks = live.engine.core.blocks
        assert blocks.pool.num_used_blocks == 0
