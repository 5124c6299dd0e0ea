"""Paged KV cache against transformers' DynamicCache and StaticCache, in one process.

Measures (a) decode tok/s at batch 1 and at batch 8 with mixed, left-padded prompts; (b) KV bytes when sampling
8 sequences from one 1,000-token prompt; (c) block waste of the paged cache on the mixed batch.
Method (hf_accel.bench): seed, one warm-up round, strategies interleaved, median of repeats, paired ratios;
decode time = time(N new tokens) - time(1 new token).

Regenerate benchmarks/results/bench_paged.json and docs/bench_paged.md:
    .venv/bin/python benchmarks/bench_paged.py
Smoke run (tiny model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_paged.py --quick
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hf_accel import bench
from hf_accel.bench.output import run_benchmark
from hf_accel.display import format_bytes, format_table

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_paged.py"
TARGETS = {"speed_vs_dynamic": 1.0, "sampling_kv_ratio": 0.25, "block_waste": 0.04}


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    prompt_lengths: list[int]
    new_tokens: int
    repeats: int  # measured repeats after one warm-up round; more where runs are short, to tame a noisy machine


@dataclass(frozen=True, slots=True)
class Plan:
    hidden_size: int
    num_layers: int
    speed: list[Scenario]  # the last one is the mixed batch used for block waste
    sampling_prompt_len: int
    num_samples: int
    sampling_new_tokens: int


FULL = Plan(
    hidden_size=256, num_layers=4,
    speed=[Scenario("batch 1, prompt 256", [256], 64, repeats=9),
           Scenario("batch 1, prompt 1920", [1920], 64, repeats=7),
           Scenario("batch 8, prompts 128-1024 (left-padded)", [128 * (i + 1) for i in range(8)], 64, repeats=5)],
    sampling_prompt_len=1000, num_samples=8, sampling_new_tokens=64,
)
QUICK = Plan(
    hidden_size=64, num_layers=2,
    speed=[Scenario("batch 1, prompt 32", [32], 16, repeats=1),
           Scenario("batch 8, prompts 8-64", [8 * (i + 1) for i in range(8)], 16, repeats=1)],
    sampling_prompt_len=100, num_samples=8, sampling_new_tokens=8,
)


def measure_speed(model: torch.nn.Module, scenario: Scenario) -> dict[str, Any]:
    inputs = bench.make_prompts(scenario.prompt_lengths, model.config.vocab_size, seed=1)
    results = bench.compare_strategies(model, inputs, scenario.new_tokens, repeats=scenario.repeats, warmup=1)
    print(f"\n{scenario.name}, {scenario.new_tokens} new tokens\n{bench.results_table(results)}", flush=True)
    return {**asdict(scenario), "results": [r.as_dict() for r in results]}


def measure_sampling_memory(model: torch.nn.Module, plan: Plan) -> dict[str, Any]:
    """KV bytes after sampling `num_samples` sequences from one prompt, per strategy, same seed for each."""
    inputs = bench.make_prompts([plan.sampling_prompt_len], model.config.vocab_size, seed=2)
    outputs = {}
    for strategy in bench.STRATEGIES:
        torch.manual_seed(0)
        _, output = bench.run_generate(model, inputs, strategy, plan.sampling_new_tokens,
                                       do_sample=True, num_return_sequences=plan.num_samples)
        outputs[strategy.name] = output
    base = outputs[bench.STRATEGIES[0].name]
    generated = slice(plan.sampling_prompt_len, None)
    base_bytes = bench.kv_bytes(base.past_key_values)
    paged = outputs["hf_accel paged"].past_key_values
    rows = [{"name": name, "kv_bytes": bench.kv_bytes(out.past_key_values),
             "kv_ratio": bench.kv_bytes(out.past_key_values) / base_bytes,
             "agreement": bench.token_agreement(out.sequences[:, generated], base.sequences[:, generated])}
            for name, out in outputs.items()]
    return {
        "prompt_len": plan.sampling_prompt_len, "num_samples": plan.num_samples,
        "new_tokens": plan.sampling_new_tokens,
        "results": rows,
        "paged_used_bytes": paged.used_bytes(),
        "paged_used_blocks": paged.pool.num_used_blocks,
        "paged_pool_blocks": paged.pool.num_blocks,
    }


def measure_waste(model: torch.nn.Module, scenario: Scenario) -> dict[str, Any]:
    """Block waste of the paged cache after generating the mixed batch; padding counted as stored, and as waste."""
    inputs = bench.make_prompts(scenario.prompt_lengths, model.config.vocab_size, seed=1)
    paged = next(s for s in bench.STRATEGIES if s.name == "hf_accel paged")
    _, output = bench.run_generate(model, inputs, paged, scenario.new_tokens)
    cache = output.past_key_values
    real_tokens = int(inputs["attention_mask"].sum()) + len(scenario.prompt_lengths) * (scenario.new_tokens - 1)
    capacity = cache.pool.num_used_blocks * cache.tables.block_size
    return {
        "scenario": scenario.name, "block_size": cache.tables.block_size,
        "used_blocks": cache.pool.num_used_blocks, "tokens_per_row": cache.tables.num_tokens,
        "block_waste": bench.block_waste(cache), "waste_counting_padding": 1 - real_tokens / capacity,
    }


def target_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for scenario in report["speed"]:
        paged = next(r for r in scenario["results"] if r["name"] == "hf_accel paged")
        ok = paged["speed_ratio"] >= TARGETS["speed_vs_dynamic"]
        target = f"decode speed >= 1.0x DynamicCache ({scenario['name']})"
        rows.append([target, f"{paged['speed_ratio']:.2f}x", _yes(ok)])
    paged = next(r for r in report["sampling"]["results"] if r["name"] == "hf_accel paged")
    rows.append([f"KV bytes <= 0.25x DynamicCache ({report['sampling']['num_samples']} samples)",
                 f"{paged['kv_ratio']:.3f}x", _yes(paged["kv_ratio"] <= TARGETS["sampling_kv_ratio"])])
    waste = report["waste"]["block_waste"]
    rows.append(["block waste < 4% (mixed batch)", f"{100 * waste:.2f}%", _yes(waste < TARGETS["block_waste"])])
    return rows


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def markdown(report: dict[str, Any]) -> str:
    hw, sampling = report["hardware"], report["sampling"]
    lines = [
        "# Paged KV cache benchmark", "",
        f"Regenerate with `{COMMAND}` ({report['runtime_s']:.0f} s here; `--quick` for a smoke run).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, "
        f"transformers {hw['transformers']}; the machine was shared with other jobs, so compare ratios, not absolutes",
        f"- model: {report['model']}", f"- dtype {report['dtype']}, greedy decoding for speed, seed {report['seed']}",
        f"- method: {report['method']}", "",
        "## Targets", "", format_table(["target", "measured", "met"], target_rows(report), markdown=True), "",
        "## Decode speed",
    ]
    for scenario in report["speed"]:
        results = [bench.StrategyResult(**r) for r in scenario["results"]]
        lines += ["", f"### {scenario['name']}, {scenario['new_tokens']} new tokens, median of "
                      f"{scenario['repeats']} repeats", "",
                  bench.results_table(results, markdown=True), "", _spread_text(results)]
    rows = [[r["name"], format_bytes(r["kv_bytes"], decimals=1), f"{r['kv_ratio']:.3f}x",
             f"{100 * r['agreement']:.1f}%"] for r in sampling["results"]]
    lines += ["", f"## KV memory: {sampling['num_samples']} sampled sequences from one {sampling['prompt_len']}-token "
              f"prompt, {sampling['new_tokens']} new tokens", "",
              format_table(["strategy", "KV bytes", "x DynamicCache", "sampled-token agreement"], rows, True), "",
              f"Paged: {sampling['paged_used_blocks']} blocks in use of a {sampling['paged_pool_blocks']}-block pool "
              f"({format_bytes(sampling['paged_used_bytes'], decimals=1)} in use); the prompt's full blocks are "
              "stored once.",
              "", "## Block waste", "", _waste_text(report["waste"])]
    return "\n".join(lines) + "\n"


def _spread_text(results: list[bench.StrategyResult]) -> str:
    base = results[0]
    parts = []
    for result in results[1:]:
        ratios = sorted(b / s for b, s in zip(base.decode_seconds, result.decode_seconds))
        parts.append(f"{result.name} {ratios[0]:.2f}x-{ratios[-1]:.2f}x")
    return f"Noise check, range of the per-repeat speed ratios to {base.name}: " + ", ".join(parts) + "."


def _waste_text(waste: dict[str, Any]) -> str:
    return (f"{waste['scenario']}: {waste['used_blocks']} blocks of {waste['block_size']} tokens hold "
            f"{waste['tokens_per_row']} positions per row. "
            f"Block waste (1 - tokens stored / (used blocks x block size)) = {100 * waste['block_waste']:.2f}%. "
            "Generate left-pads, so stored positions include padding; counting padding as waste too gives "
            f"{100 * waste['waste_counting_padding']:.1f}% (DynamicCache and StaticCache store the same padding).")


def headline(report: dict[str, Any], link: str) -> str:
    """The targets table plus how noisy the speed ratios were, for the README and docs/caches.md."""
    ratios = [b / s for scenario in report["speed"] for b, s in zip(*_decode_seconds(scenario, "hf_accel paged"))]
    return (format_table(["target", "measured", "met"], target_rows(report), markdown=True) + "\n\n"
            f"Per-repeat speed ratios of the paged cache to DynamicCache ranged {min(ratios):.2f}x-{max(ratios):.2f}x "
            f"in this run (a shared machine); the table gives their medians. From `{COMMAND}`; "
            f"all tables: [docs/bench_paged.md]({link}).")


def _decode_seconds(scenario: dict[str, Any], name: str) -> tuple[list[float], list[float]]:
    """(baseline, `name`) decode seconds per repeat."""
    results = scenario["results"]
    return results[0]["decode_seconds"], next(r for r in results if r["name"] == name)["decode_seconds"]


def run(plan: Plan, quick: bool) -> dict[str, Any]:
    """Every measurement of `plan`, as the JSON report."""
    torch.manual_seed(0)
    start = time.perf_counter()
    model = bench.random_llama(hidden_size=plan.hidden_size, num_layers=plan.num_layers, seed=0)
    report: dict[str, Any] = {
        "command": COMMAND + (" --quick" if quick else ""), "hardware": bench.hardware(), "seed": 0,
        "dtype": str(model.dtype), "model": f"{bench.describe_model(model)}; {bench.RANDOM_MODEL_NOTE}",
        "method": "one warm-up round, then the median of each scenario's repeats, strategies interleaved (order "
                  "alternating), same process; decode tok/s = rows x (N - 1) / (time(N new tokens) - time(1)), "
                  "wall clock; speed ratio = median of per-repeat ratios to DynamicCache (paired within a repeat, "
                  "so drift in machine load cancels)",
    }
    print(f"{report['model']}\n{report['hardware']}", flush=True)
    report["speed"] = [measure_speed(model, scenario) for scenario in plan.speed]
    report["sampling"] = measure_sampling_memory(model, plan)
    report["waste"] = measure_waste(model, plan.speed[-1])
    report["runtime_s"] = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(
        argv, __doc__.split("\n\n")[0], "bench_paged", ROOT, lambda quick: run(QUICK if quick else FULL, quick),
        markdown, lambda report: {"README.md": headline(report, "docs/bench_paged.md"),
                                  "docs/caches.md": headline(report, "bench_paged.md")})


if __name__ == "__main__":
    main(sys.argv[1:])
