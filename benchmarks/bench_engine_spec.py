"""Engine speculation benchmark: the serving Engine plain, with `SpeculativeConfig(method="suffix")` (prompt lookup
plus a suffix cache of earlier outputs, the default rule), with `SpeculativeConfig(method="eagle3")` (the reference
EAGLE head) and with `SpeculativeConfig(method="draft")` (the reference draft model) at 1, 4, 16 and 64 concurrent
requests.

The reference target (fp32), compiled step (the engine's default). Workloads: open continuation of held-out code
(prompt: a held-out row) and copy-heavy (the row, a blank line, then the row's first 16 tokens again: the prompt
begins to repeat a block, as in editing a file). Every round gives every engine the same new prompts (held-out
rows no earlier round used, so the suffix cache holds only other requests' outputs, as a server's would),
interleaved (the engines' order alternating every round), after one warm-up round; greedy with `ignore_eos`, so
every request makes the same number of tokens; at 1 request a few prompts run one after another. Reported per
workload and concurrency: output tokens per second over the timed rounds, the ratio to plain (total plain time /
total time) with the range of per-round ratios, and the mean tokens a speculating sequence gains per verification
(1 + accepted candidates per round). Outputs must equal plain's.

Regenerate benchmarks/results/bench_engine_spec.json, docs/bench_engine_spec.md and the tables in docs/serving.md
and docs/speculative.md:
    .venv/bin/python benchmarks/bench_engine_spec.py        (--quick: 1 and 2 requests, 12 tokens, prints only)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from hf_accel import Engine, EngineConfig, SamplingParams, SpeculativeConfig, bench, reference
from hf_accel.bench.output import run_benchmark
from hf_accel.display import format_table
from hf_accel.engine.spec_decode.speculative_config import (
    DEFAULT_EAGLE_BATCH_TOKENS, DEFAULT_EAGLE_TOKENS, DEFAULT_MAX_SPECULATIVE_BATCH_TOKENS, DEFAULT_MODEL_FREE_TOKENS,
)

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_engine_spec.py"
FULL = {"concurrency": [1, 4, 16, 64], "rounds": 3, "prompt_len": 64, "new_tokens": 48, "single_stream_prompts": 4}
QUICK = {"concurrency": [1, 2], "rounds": 1, "prompt_len": 24, "new_tokens": 12, "single_stream_prompts": 2}
WORKLOADS = ("open", "copy-heavy")
COPY_PREFIX = 16  # tokens of the block the copy-heavy prompt repeats
PLAIN, SUFFIX, EAGLE3, DRAFT = "plain", "suffix", "eagle3", "draft"
METHODS = (SUFFIX, EAGLE3, DRAFT)
TARGETS = {"1": 1.5, "4": 1.5, "64": 0.95}  # issue 26: the best method / plain at these concurrencies


class Prompts:
    """Held-out rows handed out in order, never twice: every round gets prompts no engine has seen."""

    def __init__(self, tokenizer, prompt_len: int, count: int):
        self.rows = [row.tolist() for row in reference.held_out_sequences(tokenizer, prompt_len, max_rows=count)]
        self.blank = tokenizer.encode("\n\n")
        self.next = 0

    def take(self, workload: str, count: int) -> list[list[int]]:
        rows, self.next = self.rows[self.next : self.next + count], self.next + count
        assert len(rows) == count, "not enough held-out rows for this plan"
        return rows if workload == "open" else [row + self.blank + row[:COPY_PREFIX] for row in rows]


def groups_for(prompts: Prompts, workload: str, concurrency: int, plan: dict[str, Any]) -> list[list[list[int]]]:
    """One round's prompt groups: each group runs concurrently, groups one after another."""
    if concurrency == 1:
        return [[p] for p in prompts.take(workload, plan["single_stream_prompts"])]
    return [prompts.take(workload, concurrency)]


def run_case(built: dict[str, Engine], prompts: Prompts, workload: str, concurrency: int,
             plan: dict[str, Any]) -> dict[str, Any]:
    """Interleaved rounds of every engine on the same new prompts; round 0 is a warm-up."""
    params = SamplingParams(max_tokens=plan["new_tokens"], temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in built}
    before = {name: engine.stats() for name, engine in built.items()}
    total = 0
    for round_index in range(plan["rounds"] + 1):
        groups = groups_for(prompts, workload, concurrency, plan)
        outputs = {}
        for name in list(built) if round_index % 2 == 0 else list(reversed(built)):  # no engine always runs first
            started = time.perf_counter()
            outputs[name] = [out.token_ids for group in groups for out in built[name].generate(group, params)]
            elapsed = time.perf_counter() - started
            if round_index:
                times[name].append(elapsed)
        for name, tokens in outputs.items():
            assert tokens == outputs[PLAIN], f"{name}: outputs differ from plain greedy"
        total += round_index and sum(len(group) for group in groups) * plan["new_tokens"]
    return {name: row(built[name], before[name], times[name], times[PLAIN], total) for name in built}


def row(engine: Engine, before, times: list[float], plain: list[float], total: int) -> dict[str, Any]:
    stats = engine.stats()
    drafts = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    proposed = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    return {
        "tokens_per_s": round(total / sum(times), 1),
        "ratio_to_plain": round(sum(plain) / sum(times), 3),
        "ratio_range": [round(min(p / t for p, t in zip(plain, times)), 3),
                        round(max(p / t for p, t in zip(plain, times)), 3)],
        "mean_tokens_per_speculating_step": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
    }


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    model, tokenizer = reference.load("target")
    per_round = max(max(plan["concurrency"]), plan["single_stream_prompts"])
    needed = len(WORKLOADS) * len(plan["concurrency"]) * (plan["rounds"] + 1) * per_round
    prompts = Prompts(tokenizer, plan["prompt_len"], needed)
    config = EngineConfig(max_num_seqs=max(plan["concurrency"]), enable_prefix_caching=False)
    built = {PLAIN: Engine(model, tokenizer, config=config),
             SUFFIX: Engine(model, tokenizer, config=config, speculative=SpeculativeConfig("suffix")),
             EAGLE3: Engine(model, tokenizer, config=config, speculative=SpeculativeConfig(
                 "eagle3", model=reference.load_head("eagle", model))),
             DRAFT: Engine(model, tokenizer, config=config, speculative=SpeculativeConfig(
                 "draft", model=reference.load("draft")[0]))}
    results = {workload: {str(c): run_case(built, prompts, workload, c, plan) for c in plan["concurrency"]}
               for workload in WORKLOADS}
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "model": "hf_accel reference target, fp32, compiled engine step",
        "hardware": bench.hardware(),
        "settings": {**plan, "copy_prefix": COPY_PREFIX,
                     "suffix": {"num_speculative_tokens": DEFAULT_MODEL_FREE_TOKENS,
                                "max_speculative_batch_tokens": DEFAULT_MAX_SPECULATIVE_BATCH_TOKENS},
                     **{method: {"num_speculative_tokens": DEFAULT_EAGLE_TOKENS,
                                 "max_speculative_batch_tokens": DEFAULT_EAGLE_BATCH_TOKENS}
                        for method in (EAGLE3, DRAFT)}},
        "results": results,
        "targets": {f"{workload}, {c} requests": {"target": target, "ratio": max(
                        results[workload][c][method]["ratio_to_plain"] for method in METHODS)}
                    for workload in WORKLOADS for c, target in TARGETS.items() if c in results[workload]},
    }


def headline(report: dict[str, Any]) -> str:
    """Plain vs each method per workload and concurrency, for docs/serving.md and docs/speculative.md."""
    s = report["settings"]
    rows = []
    for workload, by_concurrency in report["results"].items():
        for concurrency, results in by_concurrency.items():
            row = [workload, concurrency, f"{results[PLAIN]['tokens_per_s']:.1f}"]
            for method in METHODS:
                got, gained = results[method], results[method]["mean_tokens_per_speculating_step"]
                row += [f"{got['tokens_per_s']:.1f}", f"{got['ratio_to_plain']:.2f}x ({got['ratio_range'][0]:.2f}-"
                        f"{got['ratio_range'][1]:.2f})", "-" if gained is None else f"{gained:.2f}"]
            rows.append(row)
    columns = ["workload", "concurrent requests", "plain tok/s"]
    for method in METHODS:
        columns += [f"{method} tok/s", f"{method} ratio (per-round range)", f"{method} tokens per speculating step"]
    return "\n".join([
        f"Reference target (fp32, compiled step), {s['prompt_len']}-token held-out prompts (copy-heavy: plus a blank "
        f"line and the prompt's first {s['copy_prefix']} tokens), {s['new_tokens']} greedy tokens each (1 request: "
        f"{s['single_stream_prompts']} prompts one after another), {s['rounds']} interleaved rounds on new prompts "
        f"after a warm-up, {report['hardware']['torch_threads']} torch thread(s) of a shared CPU; "
        f"`SpeculativeConfig(method=\"suffix\")` (up to {s['suffix']['num_speculative_tokens']} candidates) and "
        f"`SpeculativeConfig(method=\"eagle3\", model=reference.load_head(\"eagle\", model))` and "
        f"`SpeculativeConfig(method=\"draft\", model=reference.load(\"draft\")[0])` (chains of up to "
        f"{s['eagle3']['num_speculative_tokens']}) with their defaults (`max_speculative_batch_tokens` "
        f"{s['suffix']['max_speculative_batch_tokens']}, {s['eagle3']['max_speculative_batch_tokens']} and "
        f"{s['draft']['max_speculative_batch_tokens']}). From "
        f"`{COMMAND}`; all numbers: [bench_engine_spec.md](bench_engine_spec.md).", "",
        format_table(columns, rows, markdown=True), "",
    ])


def markdown(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    rows = [[name, f"{t['target']:.2f}x", f"{t['ratio']:.2f}x", "met" if t["ratio"] >= t["target"] else "not met"]
            for name, t in report["targets"].items()]
    acceptance = [[workload, c] + ["-" if r[m]["acceptance_rate"] is None else f"{r[m]['acceptance_rate']:.0%}"
                                   for m in METHODS]
                  for workload, by_c in report["results"].items() for c, r in by_c.items()]
    return "\n".join([
        "# Engine speculation benchmark", "", f"Regenerate with `{COMMAND}` (`--quick` for a smoke run).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, transformers "
        f"{hw['transformers']}; the machine was shared with other jobs, so compare ratios, not absolutes",
        f"- {report['model']}", "", headline(report), "",
        "Targets (issue 26: the best method / plain):", "",
        format_table(["case", "target", "measured", ""], rows, markdown=True), "",
        "Candidates accepted:", "",
        format_table(["workload", "concurrent requests"] + [f"{m}: accepted / proposed" for m in METHODS], acceptance,
                     markdown=True), "",
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], "bench_engine_spec", ROOT, measure, markdown,
                         lambda report: {"docs/serving.md": headline(report), "docs/speculative.md": headline(report)})


if __name__ == "__main__":
    main(sys.argv[1:])
