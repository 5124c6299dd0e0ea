"""Sink cache benchmark: constant memory and decode speed far past the window, and perplexity on a long stream.

(a) Stream: one row decoded token by token to 10x the window through SinkCache and DynamicCache on a seeded
    random-weight Llama: KV bytes at 1x and 10x the window, per-token time at both points, timed side by side.
(b) Perplexity on the project's reference target model over long held-out streams (the Python stdlib files it never
    trained on), scored on every token past the first window: sinks vs a plain window of the same size vs DynamicCache
    (reset every window, and never truncated) vs the in-window level (each token recomputed from scratch on the
    window before it, StreamingLLM's "sliding window with re-computation"). Skipped, saying why, without the assets.

Regenerate benchmarks/results/bench_sink.json, docs/bench_sink.md and the table in docs/caches.md:
    .venv/bin/python benchmarks/bench_sink.py        (--quick: tiny random model, prints only unless --out is given)
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_accel import SinkCache, bench, reference
from hf_accel.bench.output import run_benchmark
from hf_accel.display import format_bytes, format_table

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_sink.py"
YES = {True: "yes", False: "**no**"}
TARGETS = {"memory_10x_over_1x": 1.0, "time_10x_over_1x": 1.2, "speed_vs_dynamic_10x": 1.0, "ppl_over_in_window": 1.1}


@dataclass(frozen=True, slots=True)
class Plan:
    hidden_size: int  # random model of part (a)
    num_layers: int
    window_length: int  # part (a)
    num_sink_tokens: int
    probe: int  # decode steps timed around 1x and 10x the window
    ppl_window: int  # part (b): window_length of both window caches and the recomputation
    ppl_stream_len: int
    ppl_rows: int
    ppl_chunk: int  # tokens per forward when streaming through a cache
    ppl_stride: int  # tokens scored per recomputation
    quick: bool = False


FULL = Plan(256, 4, window_length=256, num_sink_tokens=4, probe=64,
            ppl_window=256, ppl_stream_len=4096, ppl_rows=2, ppl_chunk=8, ppl_stride=32)
QUICK = Plan(64, 2, window_length=32, num_sink_tokens=4, probe=8,
             ppl_window=32, ppl_stream_len=256, ppl_rows=1, ppl_chunk=8, ppl_stride=8, quick=True)


@torch.no_grad()
def measure_stream(model: torch.nn.Module, plan: Plan) -> dict[str, Any]:
    """KV bytes of both caches decoding one row to 10x the window, and their per-token forward time at 1x and 10x."""
    window = plan.window_length
    total = 10 * window
    tokens = torch.randint(1, model.config.vocab_size, (1, total + plan.probe),
                           generator=torch.Generator().manual_seed(1))
    live = {"sink": SinkCache(model.config, window, plan.num_sink_tokens), "DynamicCache": DynamicCache()}
    at_one_window, memory = {}, {name: {} for name in live}
    for pos in tqdm(range(total), desc="stream", unit="token", leave=False):
        for name, cache in live.items():
            model(tokens[:, pos : pos + 1], past_key_values=cache)
        if pos + 1 == window:  # snapshot: the 1x caches are timed side by side with the 10x ones below
            at_one_window = {name: copy.deepcopy(cache) for name, cache in live.items()}
        if pos + 1 in (window, total):
            for name, cache in live.items():
                memory[name]["1x" if pos + 1 == window else "10x"] = bench.kv_bytes(cache)
    return {"window_length": window, "num_sink_tokens": plan.num_sink_tokens, "tokens": total,
            "probe_steps": plan.probe, "kv_bytes": memory,
            "seconds_per_token": time_side_by_side(model, tokens, at_one_window, live, plan.probe)}


@torch.no_grad()
def time_side_by_side(model, tokens: torch.Tensor, at_one: dict, at_ten: dict, steps: int) -> dict[str, Any]:
    """Median seconds of one decode step of each cache, all four stepping in lockstep (order rotating every step),
    so a change in machine load hits 1x and 10x alike."""
    runs = [(name, point, cache) for point, caches in (("1x", at_one), ("10x", at_ten))
            for name, cache in caches.items()]
    seconds: dict[tuple[str, str], list[float]] = {(name, point): [] for name, point, _ in runs}
    for step in range(steps):
        for name, point, cache in runs[step % len(runs):] + runs[: step % len(runs)]:
            position = cache.get_seq_length()
            start = time.perf_counter()
            model(tokens[:, position % tokens.shape[1]][:, None], past_key_values=cache)
            seconds[name, point].append(time.perf_counter() - start)
    return {name: {point: statistics.median(seconds[name, point]) for point in ("1x", "10x")} for name in at_one}


def load_stream(plan: Plan, vocab_size: int, tokenizer: Any) -> torch.Tensor:
    """`[rows, stream_len]` held-out token ids (files in corpus order, end-of-text between them); random ids for the
    quick smoke run."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(2)
        return torch.randint(1, vocab_size, (plan.ppl_rows, plan.ppl_stream_len), generator=gen)
    rows = reference.held_out_sequences(tokenizer, plan.ppl_stream_len)
    if rows.shape[0] < plan.ppl_rows:
        raise ValueError(f"the held-out split holds {rows.shape[0]} streams of {plan.ppl_stream_len} tokens, "
                         f"fewer than {plan.ppl_rows}")
    return rows[: plan.ppl_rows]


@torch.no_grad()
def streamed_nll(model, stream: torch.Tensor, make_cache, chunk: int, reset_every: int | None = None) -> torch.Tensor:
    """`[rows, len - 1]` NLL of token t + 1 given tokens <= t, feeding `chunk` tokens per forward through the cache
    `make_cache()` (a fresh one every `reset_every` tokens when set)."""
    rows, length = stream.shape
    nll, cache = torch.zeros(rows, length - 1), make_cache()
    for start in range(0, length - 1, chunk):
        if reset_every and start and start % reset_every == 0:
            cache = make_cache()
        end = min(start + chunk, length - 1)
        logits = model(stream[:, start:end], past_key_values=cache).logits.float()
        nll[:, start:end] = -logits.log_softmax(-1).gather(-1, stream[:, start + 1 : end + 1, None])[..., 0]
    return nll


@torch.no_grad()
def recomputed_nll(model, stream: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """`[rows, len - 1]` NLL (from position `window` on; earlier entries NaN): every `stride` tokens are scored by a
    forward from scratch over the window before them (context between window - stride and window - 1 tokens)."""
    rows, length = stream.shape
    nll = torch.full((rows, length - 1), math.nan)
    for target in range(window, length, stride):
        end = min(target + stride, length)
        begin = end - window
        logits = model(stream[:, begin:end], use_cache=False).logits.float()
        picked = logits[:, target - begin - 1 : end - begin - 1].log_softmax(-1)
        nll[:, target - 1 : end - 1] = -picked.gather(-1, stream[:, target:end, None])[..., 0]
    return nll


def measure_perplexity(model, tokenizer, plan: Plan, description: str) -> dict[str, Any]:
    """Perplexity of every strategy over the tokens at stream positions >= the window."""
    config, window, chunk = model.config, plan.ppl_window, plan.ppl_chunk
    stream = load_stream(plan, config.vocab_size, tokenizer)
    runs = {
        "in-window (recomputed on the last window)": lambda: recomputed_nll(model, stream, window, plan.ppl_stride),
        f"sink cache ({plan.num_sink_tokens} sinks)": lambda: streamed_nll(
            model, stream, lambda: SinkCache(config, window, plan.num_sink_tokens), chunk),
        "plain window (0 sinks)": lambda: streamed_nll(model, stream, lambda: SinkCache(config, window, 0), chunk),
        "DynamicCache reset every window": lambda: streamed_nll(model, stream, DynamicCache, chunk, window),
        "DynamicCache, full history": lambda: streamed_nll(model, stream, DynamicCache, chunk),
    }
    results = []
    for name, run in runs.items():
        start = time.perf_counter()
        nll = run()[:, window - 1 :]  # targets at positions window .. len - 1
        seconds = time.perf_counter() - start
        results.append({"name": name, "perplexity": math.exp(nll.mean().item()), "seconds": seconds})
        print(f"  {name}: perplexity {results[-1]['perplexity']:.3f}", flush=True)
    for result in results:
        result["ratio_to_in_window"] = result["perplexity"] / results[0]["perplexity"]
    return {"model": description, "window_length": window, "stream_len": plan.ppl_stream_len, "rows": plan.ppl_rows,
            "chunk": chunk, "stride": plan.ppl_stride, "max_position_embeddings": config.max_position_embeddings,
            "scored_tokens": plan.ppl_rows * (plan.ppl_stream_len - window), "results": results}


def perplexity_part(plan: Plan) -> dict[str, Any]:
    if plan.quick:
        model = bench.random_llama(hidden_size=plan.hidden_size, num_layers=plan.num_layers, seed=0)
        return measure_perplexity(model, None, plan, f"{bench.describe_model(model)}, random tokens (smoke run)")
    if not (reference.ASSETS_DIR / "target" / "config.json").is_file():
        reason = f"no reference target model yet (hf_accel/reference/assets/target); run: {reference.TRAIN_COMMAND}"
        print(f"perplexity skipped: {reason}", flush=True)
        return {"skipped": reason}
    model, tokenizer = reference.load("target")
    return measure_perplexity(model, tokenizer, plan, f"reference target: {bench.describe_model(model)}")


def target_rows(report: dict[str, Any]) -> list[list[str]]:
    stream, rows = report["stream"], []
    sink_bytes, sink_time = stream["kv_bytes"]["sink"], stream["seconds_per_token"]["sink"]
    memory_ratio = sink_bytes["10x"] / sink_bytes["1x"]
    rows.append(["KV bytes at 10x / 1x the window = 1.0", f"{memory_ratio:.2f}x",
                 YES[memory_ratio <= TARGETS["memory_10x_over_1x"]]])
    time_ratio = sink_time["10x"] / sink_time["1x"]
    rows.append(["per-token time at 10x / 1x the window <= 1.2", f"{time_ratio:.2f}x",
                 YES[time_ratio <= TARGETS["time_10x_over_1x"]]])
    speed = stream["seconds_per_token"]["DynamicCache"]["10x"] / sink_time["10x"]
    rows.append(["decode speed >= 1.0x DynamicCache at 10x the window", f"{speed:.2f}x",
                 YES[speed >= TARGETS["speed_vs_dynamic_10x"]]])
    ppl = report["perplexity"]
    if "results" in ppl:
        ratio = ppl["results"][1]["ratio_to_in_window"]
        rows.append([f"perplexity with sinks <= 1.1x in-window ({ppl['stream_len']}-token streams)",
                     f"{ratio:.3f}x", YES[ratio <= TARGETS["ppl_over_in_window"]]])
    return rows


def stream_table(stream: dict[str, Any]) -> str:
    rows = []
    for name in ("sink", "DynamicCache"):
        kv, sec = stream["kv_bytes"][name], stream["seconds_per_token"][name]
        rows.append([name, format_bytes(kv["1x"], decimals=1), format_bytes(kv["10x"], decimals=1),
                     f"{1e3 * sec['1x']:.2f}", f"{1e3 * sec['10x']:.2f}", f"{sec['10x'] / sec['1x']:.2f}x"])
    headers = ["cache", "KV at 1x window", "KV at 10x", "ms/token at 1x", "ms/token at 10x", "10x / 1x time"]
    return format_table(headers, rows, markdown=True)


def perplexity_table(ppl: dict[str, Any]) -> str:
    if "results" not in ppl:
        return f"Skipped: {ppl['skipped']}"
    rows = [[r["name"], f"{r['perplexity']:.3f}", f"{r['ratio_to_in_window']:.3f}x"] for r in ppl["results"]]
    return format_table(["strategy", "perplexity", "x in-window"], rows, markdown=True)


def headline(report: dict[str, Any], link: str) -> str:
    """Targets, stream and perplexity tables, for docs/caches.md."""
    ppl = report["perplexity"]
    where = ("" if "results" not in ppl else f"Perplexity: {ppl['model']}, {ppl['rows']} held-out streams of "
             f"{ppl['stream_len']} tokens (trained context {ppl['max_position_embeddings']}), window "
             f"{ppl['window_length']}, scored past the first window.\n\n")
    return (format_table(["target", "measured", "met"], target_rows(report), markdown=True) + "\n\n"
            + stream_table(report["stream"]) + "\n\n" + where + perplexity_table(ppl) + "\n\n"
            + f"From `{COMMAND}`; method and hardware: [{Path(link).name}]({link}).")


def markdown(report: dict[str, Any]) -> str:
    hw, stream, ppl = report["hardware"], report["stream"], report["perplexity"]
    return "\n".join([
        "# Sink cache benchmark", "",
        f"Regenerate with `{COMMAND}` ({report['runtime_s']:.0f} s here; `--quick` for a smoke run).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, transformers "
        f"{hw['transformers']}; the machine was shared with other jobs, so compare ratios, not absolutes",
        f"- stream model: {report['model']}, fp32, batch 1", "", "## Targets", "",
        format_table(["target", "measured", "met"], target_rows(report), markdown=True), "",
        f"## Memory and speed: one row decoded to {stream['tokens']} tokens (10x a window of {stream['window_length']}"
        f", {stream['num_sink_tokens']} sinks)", "",
        "Both caches decode the same tokens; copies taken at 1x the window and the caches at 10x then take "
        f"{stream['probe_steps']} more decode steps side by side (all four in lockstep, order rotating every step); "
        "time = median of those steps.", "",
        stream_table(stream), "", "## Perplexity on a long held-out stream", "",
        ("" if "results" not in ppl else
         f"{ppl['model']}; {ppl['rows']} streams x {ppl['stream_len']} tokens of held-out Python stdlib source "
         f"(trained context {ppl['max_position_embeddings']}); every strategy scores the same {ppl['scored_tokens']} "
         f"tokens (positions {ppl['window_length']} .. end). Caches are fed {ppl['chunk']} tokens per forward (a token "
         f"sees the window as it was at its chunk's start, plus its chunk); the in-window level re-runs the model "
         f"from scratch on the {ppl['window_length']} tokens ending at each group of {ppl['stride']} scored tokens."),
        "", perplexity_table(ppl), "",
    ])


def run(plan: Plan, quick: bool) -> dict[str, Any]:
    start = time.perf_counter()
    model = bench.random_llama(hidden_size=plan.hidden_size, num_layers=plan.num_layers, seed=0)
    report: dict[str, Any] = {"command": COMMAND + (" --quick" if quick else ""), "hardware": bench.hardware(),
                              "seed": 0, "model": f"{bench.describe_model(model)}; {bench.RANDOM_MODEL_NOTE}",
                              "plan": asdict(plan)}
    print(f"{report['model']}\n{report['hardware']}", flush=True)
    report["stream"] = measure_stream(model, plan)
    print(stream_table(report["stream"]), flush=True)
    report["perplexity"] = perplexity_part(plan)
    report["runtime_s"] = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], "bench_sink", ROOT,
                                      lambda quick: run(QUICK if quick else FULL, quick), markdown,
                                      lambda report: {"docs/caches.md": headline(report, "bench_sink.md")})


if __name__ == "__main__":
    main(sys.argv[1:])
