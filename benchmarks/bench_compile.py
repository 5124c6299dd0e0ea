"""Compiled generate against transformers' best: decode speed of every cache with and without `compile_config`.

Rows, at batch 1 and batch 8 (held-out code prompts of mixed lengths, left-padded; greedy; EOS off so every row
decodes the same number of tokens): eager `DynamicCache` (the baseline), transformers' `StaticCache` +
`compile_config` (forced on CPU with `CompileConfig._compile_all_devices`, as a CPU user must), hf_accel's paged
and sink caches and the int4 KV cache, eager and with `compile_config` (hf_accel's compiled loops:
`hf_accel/compiled/`; each compiled row is also checked for the same tokens as its eager row), and, when a local llama.cpp
build and a GGUF of the same weights are given (`LLAMA_BENCH`, `HF_ACCEL_LLAMA_GGUF`), llama.cpp's `llama-bench`
decode on one thread (another process, so its ratio is not paired; skipped with a message otherwise). Also the cost
of a compiled verify forward (1 + 4 and 1 + 8 tokens of one row) over a compiled decode step, speculative decoding's
price per round.
Method (hf_accel.bench): one process, one warm-up round that also compiles, strategies interleaved, median of
repeats, paired ratios; decode time = time(N new tokens) - time(1 new token). A compiled row's compile seconds are
its first call's time minus a warm call's; graphs added after the warm-up round are counted (the target is none).

Regenerate benchmarks/results/bench_compile.json, docs/bench_compile.md and the headlines in README.md and
docs/caches.md:
    .venv/bin/python benchmarks/bench_compile.py
Smoke run (tiny random model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_compile.py --quick
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.utils as dynamo_utils
from transformers import PreTrainedModel, StaticCache

from hf_accel import MedusaHeads, SpeculativeStats, bench, draft_generate, medusa_generate, ngram_generate
from hf_accel.bench.inputs import bench_prompts, copy_heavy_prompts, left_padded
from hf_accel.bench.compiled_costs import llama_cpp_decode, verify_cost
from hf_accel.bench.output import run_benchmark
from hf_accel.bench.main_rows import compile_config
from hf_accel.bench.strategies import Strategy, quantized_int4
from hf_accel.display import format_table

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_compile.py"
TARGETS = {"paged_compiled_vs_static_compiled": 1.0, "moonshot_vs_dynamic_batch1": 2.2, "compile_seconds": 60.0,
           "draft_compiled_vs_plain_compiled_batch1": 1.3}  # paged + compile over StaticCache + compile; over DynamicCache


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    batch_size: int
    longest: int  # prompt lengths spread from longest // 2 to longest (hf_accel.bench.prompt_lengths)
    new_tokens: int
    repeats: int


@dataclass(frozen=True, slots=True)
class Plan:
    model: str | None  # "reference" or None: a tiny random Llama
    scenarios: list[Scenario]


FULL = Plan("reference", [Scenario("batch 1, prompt 256, 128 new tokens", 1, 256, 128, repeats=5),
                          Scenario("batch 8, prompts 128-256, 128 new tokens", 8, 256, 128, repeats=3)])
QUICK = Plan(None, [Scenario("batch 1, prompt 32", 1, 32, 8, repeats=1),
                    Scenario("batch 2, prompts 16-32", 2, 32, 8, repeats=1)])


def sink(max_len: int) -> dict[str, Any]:
    """The sink rows' cache: a window of half the longest row (at least 64 tokens), 4 sinks."""
    return {"cache_implementation": "sink", "cache_config": {"window_length": max(max_len // 2, 64),
                                                             "num_sink_tokens": 4}}


def strategies() -> tuple[Strategy, ...]:
    """The rows, the eager `DynamicCache` baseline first; every row turns EOS off (`eos_token_id=None`)."""
    def row(name: str, description: str, extra) -> Strategy:
        return Strategy(name, description, lambda model, max_len: {"eos_token_id": None, **extra(model, max_len)})

    transformers_compile, ours = compile_config(stock=True), compile_config(stock=False)
    paged = {"cache_implementation": "paged", "cache_config": {"block_size": 16}}
    return (
        row("DynamicCache", "transformers default, eager (baseline)", lambda m, n: {}),
        row("StaticCache + compile", "transformers StaticCache, compile_config (inductor, fullgraph)",
            lambda m, n: {"past_key_values": StaticCache(config=m.config, max_cache_len=n),
                          "compile_config": transformers_compile}),
        row("hf_accel paged", "cache_implementation='paged', eager", lambda m, n: paged),
        row("hf_accel paged + compile", "cache_implementation='paged', compile_config: hf_accel's compiled loop",
            lambda m, n: {**paged, "compile_config": ours}),
        row("hf_accel sink", "cache_implementation='sink', window half the longest row (>= 64), 4 sinks, eager",
            lambda m, n: sink(n)),
        row("hf_accel sink + compile", "cache_implementation='sink', compile_config: hf_accel's compiled loop",
            lambda m, n: {**sink(n), "compile_config": ours}),
        row("hf_accel int4 KV", "cache_implementation='quantized', hf_accel backend, 4 bits, eager",
            lambda m, n: quantized_int4(m)),
        row("hf_accel int4 KV + compile", "cache_implementation='quantized', 4 bits, compile_config: hf_accel's "
            "compiled quantized loop", lambda m, n: {**quantized_int4(m), "compile_config": ours}),
    )


NOT_COVERED = ["the speculative rows here are greedy (compiled ngram_generate and draft_generate also sample "
               "losslessly; sampled medusa_generate decodes eagerly)"]


def compile_seconds(model: PreTrainedModel, inputs: dict[str, torch.Tensor], strategy: Strategy,
                    new_tokens: int) -> float:
    """First call minus a warm call of a compiled row (run before any other call of it in this process)."""
    first, _ = bench.run_generate(model, inputs, strategy, new_tokens)
    warm, _ = bench.run_generate(model, inputs, strategy, new_tokens)
    return max(first - warm, 0.0)


def measure_scenario(loaded: bench.BenchModel, scenario: Scenario, rows: tuple[Strategy, ...]) -> dict[str, Any]:
    inputs = bench_prompts(loaded, bench.prompt_lengths(scenario.longest, scenario.batch_size))
    compiled = {s.name: round(compile_seconds(loaded.model, inputs, s, scenario.new_tokens), 1)
                for s in rows if "compile" in s.name}
    graphs_before = dynamo_utils.counters["stats"]["unique_graphs"]
    results = bench.compare_strategies(loaded.model, inputs, scenario.new_tokens, rows, repeats=scenario.repeats)
    outputs = {r.name: r for r in results}
    return {"same_as_eager": same_as_eager(loaded.model, inputs, scenario.new_tokens, rows, outputs), "scenario": scenario.name, "batch_size": scenario.batch_size, "new_tokens": scenario.new_tokens,
            "prompt_lengths": inputs["attention_mask"].sum(1).tolist(), "compile_seconds": compiled,
            "graphs_added_while_timed": dynamo_utils.counters["stats"]["unique_graphs"] - graphs_before,
            "results": [r.as_dict() for r in results]}


def same_as_eager(model: PreTrainedModel, inputs: dict[str, torch.Tensor], new_tokens: int,
                  rows: tuple[Strategy, ...], results: dict[str, Any]) -> dict[str, bool]:
    """For each "X + compile" row with an eager row "X": whether both give the same greedy tokens (the sink cache's
    differ from DynamicCache's by design: its window drops tokens)."""
    by_name = {s.name: s for s in rows}
    same = {}
    for name in by_name:
        eager = name.removesuffix(" + compile")
        if name != eager and eager in by_name:
            tokens = [bench.run_generate(model, inputs, by_name[key], new_tokens)[1].sequences for key in (name, eager)]
            same[name] = bool(torch.equal(*tokens))
    return same


def speculative_strategies(draft: PreTrainedModel, stats: dict[str, SpeculativeStats],
                           heads: MedusaHeads | None = None) -> tuple[Strategy, ...]:
    """Batch-1 speculative rows over plain compiled greedy (the baseline, first); `stats` gets each speculative
    row's counters; Medusa rows when `heads` are given."""
    def row(name: str, description: str, extra: dict[str, Any]) -> Strategy:
        return Strategy(name, description, lambda model, max_len: {"eos_token_id": None, **extra})

    paged = {"cache_implementation": "paged", "cache_config": {"block_size": 16}}
    ours = {**paged, "compile_config": compile_config(stock=False)}
    stats.update({name: SpeculativeStats() for name in ("ngram eager", "ngram + compile", "draft + compile",
                                                         "medusa eager", "medusa + compile")})
    medusa = () if heads is None else (
        row("medusa eager", "medusa_generate (its adaptive default tree), eager",
            {"custom_generate": medusa_generate, "medusa_heads": heads, "medusa_stats": stats["medusa eager"]}),
        row("medusa + compile", "medusa_generate with compile_config: compiled tree verify",
            {**ours, "custom_generate": medusa_generate, "medusa_heads": heads,
             "medusa_stats": stats["medusa + compile"]}))
    return (row("plain + compile", "paged cache, compile_config: compiled greedy (baseline)", ours),
            row("ngram eager", "ngram_generate, paged cache, eager", {**paged, "custom_generate": ngram_generate,
                                                                     "ngram_stats": stats["ngram eager"]}),
            row("ngram + compile", "ngram_generate with compile_config: compiled verify",
                {**ours, "custom_generate": ngram_generate, "ngram_stats": stats["ngram + compile"]}),
            row("draft + compile", "draft_generate with compile_config: compiled draft steps and verify",
                {**ours, "custom_generate": draft_generate, "draft_model": draft,
                 "draft_stats": stats["draft + compile"]}), *medusa)


def speculative_prompts(loaded: bench.BenchModel, longest: int, copy_heavy: bool) -> dict[str, torch.Tensor]:
    """One held-out code prompt (open continuation), or one that begins to repeat itself (copy-heavy); a random
    model's random prompt, or its first half twice."""
    if loaded.tokenizer is not None and copy_heavy:
        return copy_heavy_prompts(loaded.tokenizer, [longest])
    if loaded.tokenizer is not None:
        return bench_prompts(loaded, [longest])
    ids = bench_prompts(loaded, [longest])["input_ids"][0]
    return left_padded([ids[: longest // 2].repeat(2) if copy_heavy else ids], 0)


def measure_speculation(loaded: bench.BenchModel, draft: PreTrainedModel, scenario: Scenario) -> list[dict[str, Any]]:
    """Speculative rows at batch 1 on open and copy-heavy prompts, each checked against the baseline's tokens."""
    out = []
    for kind in ("open continuation", "copy-heavy"):
        stats: dict[str, SpeculativeStats] = {}
        rows = speculative_strategies(draft, stats, loaded.medusa_heads)
        inputs = speculative_prompts(loaded, scenario.longest, kind == "copy-heavy")
        results = bench.compare_strategies(loaded.model, inputs, scenario.new_tokens, rows, repeats=scenario.repeats)
        out.append({"prompts": kind, "prompt_length": int(inputs["attention_mask"].sum()),
                    "new_tokens": scenario.new_tokens, "results": [r.as_dict() for r in results],
                    "tokens_per_forward": {name: round(s.tokens_per_forward, 2) for name, s in stats.items()}})
    return out


def load(plan: Plan) -> bench.BenchModel:
    if plan.model == "reference":
        return bench.load_bench_model(None)
    model = bench.random_llama(hidden_size=64, num_layers=2, vocab_size=256)
    return bench.BenchModel(model, None, None, bench.describe_model(model))


def run(plan: Plan) -> dict[str, Any]:
    loaded = load(plan)
    rows = strategies()
    report = {"hardware": bench.hardware(), "model": loaded.description, "targets": TARGETS,
              "command": COMMAND, "not_covered": NOT_COVERED, "scenarios": []}
    for scenario in plan.scenarios:
        print(f"{scenario.name} ...", file=sys.stderr, flush=True)
        report["scenarios"].append(measure_scenario(loaded, scenario, rows))
    draft = loaded.draft if loaded.draft is not None else bench.random_llama(hidden_size=64, num_layers=1,
                                                                             vocab_size=256)
    report["speculative"] = measure_speculation(loaded, draft, plan.scenarios[0])
    report["verify_cost"] = verify_cost(loaded.model, plan.scenarios[0].longest, plan.scenarios[0].repeats)
    report["llama_cpp"] = llama_cpp_decode(plan.scenarios[0].new_tokens)
    return report


def ratio(scenario: dict[str, Any], name: str, over: str) -> float:
    by_name = {r["name"]: r for r in scenario["results"]}
    return by_name[name]["speed_ratio"] / by_name[over]["speed_ratio"]


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Compiled generate benchmark\n\nModel: {report['model']}. CPU: {report['hardware']['cpu']}, "
             f"{report['hardware']['torch_threads']} thread(s). Regenerate: `{report['command']}`.\n"]
    for scenario in report["scenarios"]:
        headers = ["row", "decode tok/s", "x DynamicCache (paired)", "greedy agreement", "compile s"]
        table = [[r["name"], f"{r['decode_tokens_per_s']:.1f}", f"{r['speed_ratio']:.2f}x",
                  f"{100 * r['agreement']:.1f}%", str(scenario["compile_seconds"].get(r["name"], "-"))]
                 for r in scenario["results"]]
        same = ", ".join(f"{name}: {'yes' if ok else '**no**'}" for name, ok in scenario["same_as_eager"].items())
        lines += [f"## {scenario['scenario']}\n", format_table(headers, table, markdown=True), "",
                  f"Same greedy tokens as the row's eager version: {same}. (Greedy agreement is with "
                  "DynamicCache: the sink window and int4 K/V change the output by design.)\n",
                  f"hf_accel paged + compile / StaticCache + compile: "
                  f"**{ratio(scenario, 'hf_accel paged + compile', 'StaticCache + compile'):.2f}x**; graphs added "
                  f"after warm-up: {scenario['graphs_added_while_timed']}.\n"]
    cost = report["verify_cost"]
    lines.append("## Verify forward (speculative decoding's)\n\nCompiled, one row over a "
                 f"{report['scenarios'][0]['prompt_lengths'][0]}-token context: a decode step {cost['decode_ms']:.2f} "
                 f"ms; 1 + 4 tokens {cost['verify_5_ms']:.2f} ms (**{cost['verify_5_over_decode']:.2f}x**), 1 + 8 "
                 f"tokens {cost['verify_9_ms']:.2f} ms (**{cost['verify_9_over_decode']:.2f}x**; target <= 1.15x); a "
                 f"9-node Medusa tree through the paged tree attention {cost['tree_9_ms']:.2f} ms "
                 f"(**{cost['tree_9_over_decode']:.2f}x**).\n")
    lines.append(speculative_markdown(report["speculative"]))
    llama = report["llama_cpp"]
    lines.append("## llama.cpp\n\n" + (f"Skipped: {llama['skipped']}." if "skipped" in llama else
                                       f"`llama-bench` decode, one thread: {llama['decode_tokens_per_s']:.1f} tok/s."))
    lines.append("\n## Not covered yet\n\n" + "\n".join(f"- {note}" for note in report["not_covered"]) + "\n")
    return "\n".join(lines)


def speculative_markdown(sections: list[dict[str, Any]]) -> str:
    lines = ["## Speculative decoding compiled (batch 1)\n\nRatios are paired over plain compiled greedy (paged + "
             "compile); tokens per forward are per target verify forward; agreement is with the baseline's tokens.\n"]
    headers = ["row", "decode tok/s", "x plain + compile (paired)", "tokens / forward", "greedy agreement"]
    for section in sections:
        table = [[r["name"], f"{r['decode_tokens_per_s']:.1f}", f"{r['speed_ratio']:.2f}x",
                  str(section["tokens_per_forward"].get(r["name"], "-")), f"{100 * r['agreement']:.1f}%"]
                 for r in section["results"]]
        lines += [f"### {section['prompts']}, prompt {section['prompt_length']}, {section['new_tokens']} new tokens\n",
                  format_table(headers, table, markdown=True), ""]
    return "\n".join(lines)


def headline(report: dict[str, Any], link: str) -> str:
    parts = []
    for scenario in report["scenarios"]:
        by_name = {r["name"]: r["speed_ratio"] for r in scenario["results"]}
        parts.append(f"batch {scenario['batch_size']}: paged + compile {by_name['hf_accel paged + compile']:.2f}x "
                     f"eager DynamicCache, int4 KV + compile {by_name['hf_accel int4 KV + compile']:.2f}x, "
                     f"StaticCache + compile {by_name['StaticCache + compile']:.2f}x")
    return f"Compiled generate ([{link}]({link})): " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(
        argv, __doc__.split("\n\n")[0], "bench_compile", ROOT, lambda quick: run(QUICK if quick else FULL),
        markdown, lambda report: {"README.md": headline(report, "docs/bench_compile.md"),
                                  "docs/caches.md": headline(report, "bench_compile.md")})


if __name__ == "__main__":
    main()
