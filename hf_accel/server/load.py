"""Online load against an OpenAI-compatible server, measured as `vllm bench serve` does.

Requests arrive as a Poisson process at `rate` requests per second (`inf`: all at once), each a streamed completion
with the `openai` client. Per request: TTFT (send to first text chunk), TPOT ((e2e - TTFT) / (output tokens - 1)),
ITL (gaps between text chunks) and e2e latency; per run: request and output-token throughput over the wall time
from the first send to the last finish.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestTrace:
    """Times (perf_counter seconds) of one streamed request."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunks[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def arrival_offsets(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from start) of `num` requests arriving as a Poisson process at `rate` per second."""
    if math.isinf(rate):
        return [0.0] * num
    rng, now, offsets = random.Random(seed), 0.0, []
    for _ in range(num):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def _send(client: Any, model: str, prompt: list[int], max_tokens: int, delay: float) -> RequestTrace:
    await asyncio.sleep(delay)
    trace = RequestTrace(time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            trace.chunks.append(time.perf_counter())
        if chunk.usage is not None:
            trace.output_tokens = chunk.usage.completion_tokens
    return trace


async def run_load(base_url: str, model: str, requests: list[tuple[list[int], int]], rate: float,
                   seed: int = 0) -> dict[str, Any]:
    """Send `requests` (prompt token ids, max_tokens) at `rate`; returns throughputs and latency statistics (ms)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        offsets = arrival_offsets(len(requests), rate, seed)
        start = time.perf_counter()
        traces = await asyncio.gather(*(_send(client, model, p, n, d) for (p, n), d in zip(requests, offsets)))
        duration = time.perf_counter() - start
    itl = [b - a for t in traces for a, b in zip(t.chunks, t.chunks[1:])]
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "requests": len(traces),
        "duration_s": duration,
        "request_throughput": len(traces) / duration,
        "output_token_throughput": sum(t.output_tokens for t in traces) / duration,
        "ttft_ms": summary([t.ttft for t in traces]),
        "tpot_ms": summary([t.tpot for t in traces if t.tpot is not None]),
        "itl_ms": summary(itl),
        "e2e_ms": summary([t.e2e for t in traces]),
    }


def summary(seconds: list[float]) -> dict[str, float]:
    """Mean, median and 99th percentile, in milliseconds."""
    if not seconds:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": 1e3 * statistics.fmean(ordered), "median": 1e3 * statistics.median(ordered), "p99": 1e3 * p99}
