"""Step time per batch size for bench_lora.py: one engine step of B sequences decoding one token each, on the base
engine and on the LoRA engine (base requests, and the B requests spread over the adapters), interleaved.

Each measurement adds B requests (the first `PROMPT_TOKENS` tokens of held-out prompts, `MAX_TOKENS` new tokens,
EOS ignored), steps untimed until every one has its first token (their prefills), times the next `TIMED_STEPS` steps
(each B decode tokens), and steps the rest away; the median step is the figure.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from hf_accel import Engine, LoRARequest, SamplingParams
from hf_accel.bench.timing import time_interleaved
from hf_accel.bench.workload import Request

BATCH_SIZES = (1, 4, 16, 64)
PROMPT_TOKENS = 16
MAX_TOKENS = 24
TIMED_STEPS = 16


def decode_step_seconds(engine: Engine, prompts: list[list[int]], adapters: list[LoRARequest | None]) -> float:
    """The median seconds of one decode step of `len(prompts)` sequences (request i on `adapters[i]`)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for prompt, adapter in zip(prompts, adapters):
        engine.add_request(prompt, params, lora_request=adapter)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefills (chunked or not) until every request has a token
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    seconds = []
    for _ in range(TIMED_STEPS):
        begin = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - begin)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(seconds)


def step_times(base: Engine, served: Engine, work: list[Request], adapters: list[LoRARequest],
               repeats: int) -> list[dict[str, Any]]:
    """Per batch size: milliseconds of a decode step on `base` (base requests) and on `served` (base requests; the
    batch spread over `adapters`, request i on adapter i mod their count), and each LoRA side over the base."""
    rows = []
    for size in BATCH_SIZES:
        prompts = [r.prompt[:PROMPT_TOKENS] for r in (work * -(-size // len(work)))[:size]]
        spread = [adapters[i % len(adapters)] for i in range(size)]
        runs = {"base": (base, [None] * size), "lora_base": (served, [None] * size), "lora_mixed": (served, spread)}
        timings = time_interleaved(list(runs), lambda key: (decode_step_seconds(runs[key][0], prompts, runs[key][1]),
                                                            None), repeats)
        ms = {key: 1000 * statistics.median(timings.seconds[key]) for key in runs}
        rows.append({"batch": size, "base_ms": ms["base"], "lora_base_ms": ms["lora_base"],
                     "lora_mixed_ms": ms["lora_mixed"], "mixed_vs_base": ms["base"] / ms["lora_mixed"]})
    return rows


def render_step_times(rows: list[dict[str, Any]], adapters: int) -> list[str]:
    """The markdown table of `step_times`' rows."""
    lines = ["| batch | base engine step (ms) | LoRA engine, base requests (ms) | LoRA engine, "
             f"{adapters} adapters (ms) | base / {adapters} adapters |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {row['batch']} | {row['base_ms']:.2f} | {row['lora_base_ms']:.2f} | {row['lora_mixed_ms']:.2f} | "
              f"{row['mixed_vs_base']:.2f}x |" for row in rows]
    return lines
