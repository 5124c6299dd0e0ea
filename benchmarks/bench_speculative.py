"""Speculative decoding benchmark: hf_accel's draft-model path against plain generate and transformers' assisted
decoding, on the project's reference pair (target ~8.9M parameters, draft ~0.9M, same tokenizer).

For greedy and sampling, at batch 1 and batch 4 (left-padded held-out prompts), every method runs in one process,
interleaved, after a warm-up (`hf_accel.bench.compare_strategies`: decode time = time(N tokens) - time(1 token),
median of per-repeat paired ratios). One more untimed run per method counts target forwards and, where the method
reports them, accepted drafts per position. Tokens per target forward has `SpeculativeStats`' definition: tokens a row
gains per verification forward, the prefill not counted (plain decoding is 1.0); from the method's stats where it
keeps them, else from the forwards counted (exact at batch 1 and for plain decoding).

Add a method (Medusa heads, ...) by writing a function `(pair, mode, batch_size) -> Method | None` and listing it in
`METHODS`. Regenerate benchmarks/results/bench_speculative.json, docs/bench_speculative.md and the table in
docs/speculative.md with:
    .venv/bin/python benchmarks/bench_speculative.py        (--quick: small lengths, prints only unless --out)
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hf_accel
from hf_accel import bench, reference
from hf_accel.bench.output import benchmark_parser, output_root, write_results
from hf_accel.display import format_table

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_speculative"
COMMAND = ".venv/bin/python benchmarks/bench_speculative.py"
TARGETS = {"x plain": 2.0, "x stock assisted": 1.2}  # for the hf_accel draft row
MODES = {"greedy": {"do_sample": False},
         "sampling": {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}}


@dataclass(frozen=True, slots=True)
class Plan:
    prompt_lengths: dict[int, list[int]]  # batch size -> prompt lengths
    new_tokens: int
    repeats: int
    warmup: int


FULL = Plan({1: [128], 4: [128, 112, 96, 80]}, new_tokens=128, repeats=5, warmup=1)
QUICK = Plan({1: [32], 4: [32, 24, 28, 20]}, new_tokens=16, repeats=1, warmup=1)


@dataclass(frozen=True, slots=True)
class Pair:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any
    description: str


@dataclass(frozen=True, slots=True)
class Method:
    """One row: how to generate, and (optional) a fresh stats object handed to generate as `stats_kwarg`, with a
    function reading acceptance figures out of it."""

    strategy: bench.Strategy
    stats_kwarg: str | None = None
    make_stats: Callable[[], Any] | None = None
    read_stats: Callable[[Any], dict[str, Any]] | None = None


def load_pair() -> Pair:
    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    return Pair(target, draft, tokenizer,
                f"reference target ({bench.describe_model(target)}), draft ({bench.describe_model(draft)}), fp32")


def plain_method(pair: Pair, mode: str, batch_size: int) -> Method:
    return Method(bench.Strategy("plain generate", "model.generate, DynamicCache (baseline)",
                                 lambda model, max_len: dict(MODES[mode])))


def stock_assisted_method(pair: Pair, mode: str, batch_size: int) -> Method | None:
    if batch_size != 1:
        return None  # transformers' assisted decoding supports batch size 1 only
    return Method(bench.Strategy("transformers assisted", "assistant_model=draft (stock heuristic draft length)",
                                 lambda model, max_len: {**MODES[mode], "assistant_model": pair.draft}))


def hf_accel_draft_method(pair: Pair, mode: str, batch_size: int) -> Method:
    def kwargs(model, max_len):
        return {**MODES[mode], "custom_generate": hf_accel.draft_generate, "draft_model": pair.draft}

    def read(stats: hf_accel.SpeculativeStats) -> dict[str, Any]:
        return {"tokens_per_target_forward": stats.tokens_per_forward, "acceptance_rate": stats.acceptance_rate,
                "acceptance_by_position": stats.acceptance_by_position,
                "mean_draft_length": statistics.mean(stats.draft_lengths) if stats.draft_lengths else 0.0}

    return Method(bench.Strategy("hf_accel draft", "custom_generate=hf_accel.draft_generate, adaptive draft length",
                                 kwargs), "draft_stats", hf_accel.SpeculativeStats, read)


METHODS: tuple[Callable[[Pair, str, int], Method | None], ...] = (plain_method, stock_assisted_method,
                                                                     hf_accel_draft_method)


def count_forwards(model: torch.nn.Module, run: Callable[[], Any]) -> int:
    """Forward calls of `model` (not its submodules) while `run()` executes."""
    calls = [0]
    handle = model.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    try:
        run()
    finally:
        handle.remove()
    return calls[0]


def profile(pair: Pair, method: Method, inputs: dict[str, torch.Tensor], new_tokens: int) -> dict[str, Any]:
    """Target forwards and acceptance of one untimed run."""
    stats = method.make_stats() if method.make_stats else None
    extra = {method.stats_kwarg: stats} if stats is not None else {}
    max_len = inputs["input_ids"].shape[1] + new_tokens
    options = {**method.strategy.generate_kwargs(pair.target, max_len), **extra}
    torch.manual_seed(0)
    forwards = count_forwards(pair.target, lambda: pair.target.generate(
        **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options))
    found = {"tokens_per_target_forward": (new_tokens - 1) / max(forwards - 1, 1), "target_forwards": forwards}
    return found | (method.read_stats(stats) if stats is not None else {})


def measure(pair: Pair, mode: str, batch_size: int, plan: Plan) -> dict[str, Any]:
    methods = [m for m in (make(pair, mode, batch_size) for make in METHODS) if m is not None]
    inputs = bench.text_prompts(pair.tokenizer, plan.prompt_lengths[batch_size])
    torch.manual_seed(0)
    results = bench.compare_strategies(pair.target, inputs, plan.new_tokens, [m.strategy for m in methods],
                                       repeats=plan.repeats, warmup=plan.warmup,
                                       on_step=lambda name: print(f"  {mode} batch {batch_size}: {name}", flush=True))
    seconds = {r.name: r.decode_seconds for r in results}
    rows = []
    for method, result in zip(methods, results):
        row = {"name": result.name, "description": method.strategy.description,
               "decode_tokens_per_s": result.decode_tokens_per_s, "x_plain": result.speed_ratio,
               "greedy_agreement": result.agreement if mode == "greedy" else None,
               "decode_seconds": result.decode_seconds}
        if "transformers assisted" in seconds:
            row["x_stock_assisted"] = statistics.median(
                a / s for a, s in zip(seconds["transformers assisted"], seconds[result.name]))
        rows.append(row | profile(pair, method, inputs, plan.new_tokens))
    return {"mode": mode, "batch_size": batch_size, "prompt_lengths": plan.prompt_lengths[batch_size],
            "new_tokens": plan.new_tokens, "generate_kwargs": MODES[mode], "rows": rows}


def run(plan: Plan) -> dict[str, Any]:
    pair = load_pair()
    measurements = [measure(pair, mode, batch, plan) for mode in MODES for batch in plan.prompt_lengths]
    return {"command": COMMAND, "model": pair.description, "hardware": bench.hardware(),
            "prompts": "held-out text (reference corpus split never trained on), left-padded",
            "repeats": plan.repeats, "warmup": plan.warmup, "measurements": measurements, "targets": targets(measurements)}


def targets(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for m in measurements:
        ours = next(r for r in m["rows"] if r["name"] == "hf_accel draft")
        for key, goal in (("x_plain", TARGETS["x plain"]), ("x_stock_assisted", TARGETS["x stock assisted"])):
            if key in ours:
                found.append({"target": f"hf_accel draft {key.replace('_', ' ')} >= {goal}x ({m['mode']}, batch "
                                        f"{m['batch_size']})", "measured": ours[key], "met": ours[key] >= goal})
    return found


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def table(measurement: dict[str, Any]) -> str:
    headers = ["method", "decode tok/s", "x plain (paired)", "x stock assisted (paired)", "tokens / target forward",
               "acceptance", "acceptance by draft position", "mean draft length", "greedy agreement"]
    rows = [[r["name"], f"{r['decode_tokens_per_s']:.1f}", f"{r['x_plain']:.2f}x", _cell(r, "x_stock_assisted", "{:.2f}x"),
             f"{r['tokens_per_target_forward']:.2f}", _cell(r, "acceptance_rate", "{:.0%}"),
             " ".join(f"{a:.2f}" for a in r.get("acceptance_by_position", [])[:8]) or "-",
             _cell(r, "mean_draft_length", "{:.1f}"), _cell(r, "greedy_agreement", "{:.1%}")]
            for r in measurement["rows"]]
    return format_table(headers, rows, markdown=True)


def markdown(report: dict[str, Any]) -> str:
    parts = [f"Model: {report['model']}. Hardware: {report['hardware']['cpu']}, {report['hardware']['torch_threads']} "
             f"torch thread(s), torch {report['hardware']['torch']}, transformers {report['hardware']['transformers']}. "
             f"Prompts: {report['prompts']}. Median of {report['repeats']} interleaved repeats after "
             f"{report['warmup']} warm-up; ratios are medians of per-repeat paired ratios. From `{report['command']}`."]
    for m in report["measurements"]:
        parts.append(f"### {m['mode']}, batch {m['batch_size']} (prompts {m['prompt_lengths']}, {m['new_tokens']} new "
                     f"tokens, {m['generate_kwargs']})\n\n{table(m)}")
    rows = [[t["target"], f"{t['measured']:.2f}x", "yes" if t["met"] else "**no**"] for t in report["targets"]]
    parts.append("### Targets\n\n" + format_table(["target", "measured", "met"], rows, markdown=True))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = benchmark_parser(__doc__.split("\n\n")[0], NAME).parse_args(argv)
    if not reference.has_assets():
        raise SystemExit(f"the reference pair is missing; create it with: {reference.TRAIN_COMMAND}")
    with bench.torch_threads(args.threads):
        report = run(QUICK if args.quick else FULL)
    text = markdown(report)
    print("\n" + text)
    out = output_root(args, ROOT)
    if out is not None:  # docs/speculative.md quotes the tables between its bench_speculative markers
        write_results(out, NAME, report, "# Speculative decoding benchmark\n\n" + text,
                      {"docs/speculative.md": text.rstrip("\n")})
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
