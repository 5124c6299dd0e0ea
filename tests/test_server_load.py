"""The server under load and under clients that leave: 32 concurrent streams of mixed prompt and output lengths
each equal their own single-request greedy `generate`; a client that disconnects mid-stream (or before a
non-streamed reply) gets its request aborted and its blocks back in the pool, seen through the engine and /metrics."""

import asyncio
import itertools
import logging
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_helpers import HeldSteps, assert_greedy_equal, greedy_reference
from hf_accel import reference
from server_helpers import MODEL_NAME, live_server, load_target

NUM_REQUESTS = 32
METRIC_NAMES = [
    "hf_accel:num_requests_running", "hf_accel:num_requests_waiting", "hf_accel:kv_cache_usage_perc",
    "hf_accel:num_preemptions", "hf_accel:prefix_cache_queries", "hf_accel:prefix_cache_hits",
    "hf_accel:prompt_tokens", "hf_accel:generation_tokens", "hf_accel:request_success",
    "hf_accel:time_to_first_token_seconds", "hf_accel:inter_token_latency_seconds",
    "hf_accel:e2e_request_latency_seconds", "hf_accel:request_queue_time_seconds",
]


@pytest.fixture(scope="module")
def server():
    model, tokenizer = load_target()
    # fewer slots than requests and small prefill chunks: requests queue, join mid-flight and mix with prefills
    with live_server(model, tokenizer, max_num_seqs=16, max_num_batched_tokens=256) as live:
        yield live


@pytest.fixture(scope="module")
def ref_model():
    return reference.load("target")[0]


def scrape(server) -> dict[str, dict]:
    """/metrics as {family name: {sample name: value}} (first sample per name, labels ignored)."""
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    return {family.name: {s.name: s.value for s in reversed(family.samples)} for family in families}


def aborted_requests(server) -> float:
    """`hf_accel:request_success_total{finished_reason="abort"}` from /metrics (0 before any abort)."""
    samples = scrape_samples(server)
    return sum(s.value for s in samples if s.name == "hf_accel:request_success_total"
               and s.labels.get("finished_reason") == "abort")


def scrape_samples(server) -> list:
    text = httpx.get(f"{server.url}/metrics").text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def pool_is_free(server) -> bool:
    stats = server.engine.stats()
    return stats.num_free_blocks == stats.num_blocks and stats.num_requests_running == 0


async def stream_one(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[list[int], str, str]:
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens, text, reason = [], "", None
    async for chunk in stream:
        (choice,) = chunk.choices
        tokens += choice.token_ids
        text += choice.text
        reason = choice.finish_reason or reason
    return tokens, text, reason


async def stream_all(url: str, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], str, str]]:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(stream_one(client, p, m) for p, m in zip(prompts, max_tokens)))


def test_concurrent_streams_each_equal_their_own_greedy_generate(server, ref_model):
    rng = random.Random(0)
    rows = reference.held_out_sequences(server.tokenizer, seq_len=200, max_rows=NUM_REQUESTS)
    prompts = [row[: rng.randint(16, 200)].tolist() for row in rows]
    max_tokens = [rng.randint(4, 48) for _ in prompts]
    results = asyncio.run(stream_all(server.api_url, prompts, max_tokens))
    assert len(results) == NUM_REQUESTS
    for prompt, count, (tokens, text, reason) in zip(prompts, max_tokens, results):
        assert reason == "length" and len(tokens) == count
        assert_greedy_equal(ref_model, prompt, tokens, greedy_reference(ref_model, prompt, count))
        assert text == server.tokenizer.decode(tokens, skip_special_tokens=True)
    assert wait_until(lambda: pool_is_free(server))


def test_disconnect_mid_stream_aborts_and_frees_the_blocks(server, monkeypatch):
    max_tokens = server.engine.max_model_len - 16
    body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    aborted, tokens_before = aborted_requests(server), server.engine.stats().generation_tokens
    steps = HeldSteps(server.engine, monkeypatch)
    steps.allow(5)  # the prefill and four decode steps: five tokens, then the engine waits for the test
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                events = (line for line in response.iter_lines() if line.startswith("data: "))
                assert len(list(itertools.islice(events, 5))) == 5  # five tokens streamed, hundreds to go
                assert server.engine.stats().num_requests_running == 1
                assert server.engine.stats().num_free_blocks < server.engine.stats().num_blocks
        # the connection is closed: the request is aborted and its blocks come back without waiting for the rest
        assert steps.step_until(lambda: pool_is_free(server), timeout=5.0)
    finally:
        steps.release()
    metrics = scrape(server)
    assert metrics["hf_accel:kv_cache_usage_perc"]["hf_accel:kv_cache_usage_perc"] == 0
    assert metrics["hf_accel:num_requests_running"]["hf_accel:num_requests_running"] == 0
    assert aborted_requests(server) == aborted + 1
    assert server.engine.stats().generation_tokens - tokens_before < max_tokens


def test_disconnect_before_a_non_streamed_reply_aborts(server, monkeypatch, caplog):
    max_tokens = server.engine.max_model_len - 16
    body = {"model": MODEL_NAME, "prompt": "import os", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    aborted, tokens_before = aborted_requests(server), server.engine.stats().generation_tokens
    steps = HeldSteps(server.engine, monkeypatch)
    steps.allow(5)  # five tokens, then the engine waits: the reply cannot be whole before the client leaves
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        assert steps.step_until(lambda: pool_is_free(server), timeout=5.0)
    finally:
        steps.release()
    assert server.engine.stats().generation_tokens - tokens_before < max_tokens
    assert aborted_requests(server) == aborted + 1
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]  # no 500 behind the abort


def test_metrics_expose_every_name_and_agree_with_the_engine(server):
    asyncio.run(stream_all(server.api_url, [[5, 6, 7, 8]], [6]))
    assert wait_until(lambda: pool_is_free(server))
    metrics = scrape(server)
    assert set(METRIC_NAMES) <= set(metrics)
    stats = server.engine.stats()
    assert metrics["hf_accel:generation_tokens"]["hf_accel:generation_tokens_total"] == stats.generation_tokens
    assert metrics["hf_accel:prompt_tokens"]["hf_accel:prompt_tokens_total"] == stats.prompt_tokens
    for name in METRIC_NAMES[-4:]:
        assert metrics[name][f"{name}_count"] > 0, name
