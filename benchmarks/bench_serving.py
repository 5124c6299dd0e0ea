"""Serving benchmark: hf_accel's Engine against sequential `generate`, static batches and transformers' own
continuous batching, on the reference target with held-out prompts and mixed output lengths.

Offline mix: requests with prompts of 32-400 held-out tokens and `max_tokens` drawn from 16-256 (capped so prompt
plus output fits the model's context), greedy, every request generating exactly its `max_tokens` (EOS ignored).
Sequential: one `generate` per request. Static: batches of 8 in arrival order, left-padded, each running until its
longest row ends (the shorter rows' extra tokens are wasted). transformers CB: `model.continuous_batching_context_
manager` (the machinery behind `generate_batch`) with each request's own `max_new_tokens`. Engine:
`hf_accel.Engine.generate`. Generated tok/s counts only the tokens each request asked for. The batched methods run
interleaved over repeats after a warm-up; the sequential run (slowest) runs once and its outputs are the reference
every Engine output is compared with. Also: Engine throughput against `max_num_seqs` (plot), and time to first
token with and without prefix caching for requests sharing a 256-token system prompt, arriving at a steady rate;
and online serving through the HTTP server (`hf_accel.server.load`: Poisson arrivals, TTFT / TPOT / ITL / e2e).
    .venv/bin/python benchmarks/bench_serving.py        (--quick: tiny model, prints only unless --out)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_accel import Engine, EngineConfig, SamplingParams, bench, reference
from hf_accel.bench import describe_model
from hf_accel.bench.output import benchmark_parser, output_root, run_benchmark
from hf_accel.bench.peer import free_port, load_server
from hf_accel.engine.limits import context_length
from hf_accel.bench.workload import Request, compare_outputs, engine_outputs, sequential_outputs, serving_requests

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_serving"
COMMAND = ".venv/bin/python benchmarks/bench_serving.py"
TARGETS = {"x static batching": 2.0, "x transformers CB": 5.0, "prefix TTFT p50 ratio": 0.5}


@dataclass(frozen=True, slots=True)
class Plan:
    num_requests: int
    prompt_range: tuple[int, int]
    max_tokens_range: tuple[int, int]
    repeats: int
    sweep_seqs: tuple[int, ...]
    sweep_requests: int
    prefix_requests: int
    header_len: int
    prefix_interval_s: float
    online_requests: int
    online_rates: tuple[float, ...]


FULL = Plan(64, (32, 400), (16, 256), 2, (1, 4, 16, 64), 24, 64, 256, 0.05, 48, (1.0, 2.0, 4.0, float("inf")))
QUICK = Plan(6, (8, 40), (4, 12), 1, (1, 4), 4, 4, 32, 0.0, 4, (8.0, float("inf")))


def workload(tokenizer, plan: Plan, max_len: int, seed: int = 0) -> list[Request]:
    return serving_requests(tokenizer, plan.num_requests, plan.prompt_range, plan.max_tokens_range, max_len, seed)


def run_static(model, work: list[Request], batch_size: int = 8) -> None:
    for start in range(0, len(work), batch_size):
        chunk = work[start : start + batch_size]
        width = max(len(r.prompt) for r in chunk)
        pad = model.generation_config.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in chunk])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in chunk])
        longest = max(r.max_tokens for r in chunk)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)


def run_transformers_cb(model, work: list[Request], max_len: int) -> None:
    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=max(r.max_tokens for r in work))
    # the Engine's budget: 512 tokens per step, a pool for 64 sequences of max_len tokens (left to itself, transformers
    # sizes its cache from free memory: gigabytes on a CPU host)
    pages = ContinuousBatchingConfig(num_blocks=-(-64 * max_len // 256), max_batch_tokens=512)
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=pages,
                                                   block=True, timeout=5) as manager:
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens, eos_token_id=-1) for r in work]
        done = 0
        while done < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread died")


def timed(fn, *args) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def offline(model, tokenizer, plan: Plan) -> dict[str, Any]:
    engine_len = Engine(model, tokenizer).max_model_len
    work = workload(tokenizer, plan, engine_len)
    asked = sum(r.max_tokens for r in work)
    engine = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=512))
    warm = work[:2]
    run_static(model, warm), run_transformers_cb(model, warm, engine_len), engine_outputs(engine, warm)
    reference_out, sequential_s = timed(sequential_outputs, model, work)
    seconds: dict[str, list[float]] = {"static batches of 8": [], "transformers CB": [], "hf_accel Engine": []}
    engine_out = None
    for _ in range(plan.repeats):
        seconds["static batches of 8"].append(timed(run_static, model, work)[1])
        seconds["transformers CB"].append(timed(run_transformers_cb, model, work, engine_len)[1])
        engine_out, engine_s = timed(engine_outputs, engine, work)
        seconds["hf_accel Engine"].append(engine_s)
    rates = {"sequential generate": asked / sequential_s}
    rates.update({name: asked / statistics.median(times) for name, times in seconds.items()})
    return {"requests": len(work), "generated_tokens": asked,
            "prompt_tokens": sum(len(r.prompt) for r in work), "tokens_per_s": rates,
            "seconds": {"sequential generate": [sequential_s], **seconds},
            "equality": compare_outputs(model, work, engine_out, reference_out)}


def sweep(model, tokenizer, plan: Plan) -> dict[str, float]:
    work = workload(tokenizer, plan, Engine(model, tokenizer).max_model_len, seed=1)[: plan.sweep_requests]
    rates = {}
    for seqs in plan.sweep_seqs:
        engine = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=seqs))
        engine_outputs(engine, work[:1])
        rates[str(seqs)] = sum(r.max_tokens for r in work) / timed(engine_outputs, engine, work)[1]
    return rates


def prefix_ttft(model, tokenizer, plan: Plan) -> dict[str, Any]:
    """TTFT of requests sharing a system prompt, arriving every `prefix_interval_s` at a running engine."""
    rows = reference.held_out_sequences(tokenizer, seq_len=plan.header_len + 64, max_rows=plan.prefix_requests + 1)
    header = rows[0, : plan.header_len].tolist()
    prompts = [header + rows[i + 1, plan.header_len : plan.header_len + 16 + i % 48].tolist()
               for i in range(plan.prefix_requests)]
    result = {}
    for enabled in (False, True):
        engine = Engine(model, tokenizer, config=EngineConfig(enable_prefix_caching=enabled))
        engine.generate([header + [header[-1]]], SamplingParams(max_tokens=1, temperature=0))  # warms the cache
        result["with" if enabled else "without"] = _ttfts(engine, prompts, plan.prefix_interval_s)
        engine.shutdown()
    return {name: {"p50_s": statistics.median(t), "mean_s": statistics.fmean(t)} for name, t in result.items()}


def _ttfts(engine: Engine, prompts: list[list[int]], interval: float) -> list[float]:
    finished, done = [], threading.Event()

    def listen(out):
        if out.finished:
            finished.append(out.timing.time_to_first_token)
            if len(finished) == len(prompts):
                done.set()

    engine.start()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), listener=listen)
        time.sleep(interval)
    done.wait()
    return finished


def online(model, tokenizer, plan: Plan) -> list[dict[str, Any]]:
    """Through `hf-accel serve` (its own process, and the engine in one of its own, as users run it) on a loopback
    port with the `openai` client, at each arrival rate; the model is saved to a temporary folder it serves."""
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp:
        folder, port = Path(tmp) / "model", free_port()
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        work = workload(tokenizer, plan, context_length(model), seed=2)[: plan.online_requests]
        requests = [(r.prompt, min(r.max_tokens, 128)) for r in work]
        command = [sys.executable, "-m", "hf_accel.cli", "serve", "--model", str(folder), "--port", str(port),
                   "--host", "127.0.0.1", "--served-model-name", NAME, "--max-num-seqs", "64",
                   "--threads", str(torch.get_num_threads()), "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return load_server(command, env, Path(tmp) / "server.txt", port, NAME, requests, plan.online_rates)


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    model, tokenizer = (reference.load("draft") if quick else reference.load("target"))
    report = {"benchmark": NAME, "command": COMMAND, "hardware": bench.hardware(), "plan": asdict(plan),
              "model": describe_model(model),
              "offline": offline(model, tokenizer, plan), "max_num_seqs_sweep": sweep(model, tokenizer, plan),
              "prefix_caching": prefix_ttft(model, tokenizer, plan), "online": online(model, tokenizer, plan)}
    rates = report["offline"]["tokens_per_s"]
    engine = rates["hf_accel Engine"]
    prefix = report["prefix_caching"]
    report["targets"] = {
        "x static batching": engine / rates["static batches of 8"],
        "x transformers CB": engine / rates["transformers CB"],
        "prefix TTFT p50 ratio": prefix["with"]["p50_s"] / prefix["without"]["p50_s"],
    }
    return report


def render(report: dict[str, Any]) -> str:
    off, rates = report["offline"], report["offline"]["tokens_per_s"]
    engine = rates["hf_accel Engine"]
    lines = [f"Offline mix: {off['requests']} requests, {off['prompt_tokens']} prompt tokens, "
             f"{off['generated_tokens']} generated tokens, greedy, {report['model']}.", "",
             "| method | generated tok/s | Engine speed-up |", "| --- | --- | --- |"]
    lines += [f"| {name} | {rate:.1f} | {engine / rate:.2f}x |" for name, rate in rates.items()]
    eq = off["equality"]
    lines += ["", f"Engine outputs identical to sequential greedy `generate`: {eq['identical']}/{eq['requests']}"
              + (f" (the others first differ at near ties, top-2 logit gaps {eq['first_difference_top2_gaps']})"
                 if eq["first_difference_top2_gaps"] else "") + ".", "",
              "| max_num_seqs | Engine tok/s |", "| --- | --- |"]
    lines += [f"| {seqs} | {rate:.1f} |" for seqs, rate in report["max_num_seqs_sweep"].items()]
    pre = report["prefix_caching"]
    lines += ["", "| prefix caching | TTFT p50 (ms) | TTFT mean (ms) |", "| --- | --- | --- |"]
    lines += [f"| {name} | {v['p50_s'] * 1e3:.1f} | {v['mean_s'] * 1e3:.1f} |" for name, v in pre.items()]
    lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
    for name, goal in TARGETS.items():
        value = report["targets"][name]
        met = value <= goal if "ratio" in name else value >= goal
        lines.append(f"| {name} {'<=' if 'ratio' in name else '>='} {goal} | {value:.2f} | {'yes' if met else 'no'} |")
    lines += ["", "Online, through `hf-accel serve` in its own process (the engine in an engine-core process) with the "
              "`openai` client (streamed completions, Poisson arrivals; latencies in ms, mean / median / p99):", "",
              "| rate (req/s) | req/s | output tok/s | TTFT | TPOT | ITL | e2e |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['rate']} | {r['request_throughput']:.2f} | {r['output_token_throughput']:.1f} | "
              + " | ".join("/".join(f"{r[k][s]:.0f}" for s in ("mean", "median", "p99"))
                           for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")) + " |" for r in report["online"]]
    lines += ["", f"![Engine throughput against max_num_seqs]({NAME}.png)"]
    return "\n".join(lines) + f"\n\nFrom `{report['command']}`.\n"


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    """Engine generated tok/s against `max_num_seqs` (PNG). No other method is drawn: the sweep runs after the
    interleaved comparison, so its absolute rates are not comparable with that table's on a shared machine."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    sweep = report["max_num_seqs_sweep"]
    figure, axes = plt.subplots(figsize=(5, 3.2))
    axes.plot([int(k) for k in sweep], list(sweep.values()), marker="o", label="hf_accel Engine")
    axes.set(xscale="log", xlabel="max_num_seqs", ylabel="generated tokens / s", title="Throughput, reference target")
    axes.set_xticks([int(k) for k in sweep], [str(k) for k in sweep])
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    report = run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render,
                           lambda report: {"docs/serving.md": render(report)})
    out = output_root(benchmark_parser("", NAME).parse_args(argv), ROOT)
    if out is not None:
        plot_sweep(report, out / "docs" / f"{NAME}.png")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
