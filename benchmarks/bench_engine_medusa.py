"""Engine Medusa benchmark: the serving Engine with and without Medusa heads at 1, 4, 8 and 16 concurrent requests.

The reference target (fp32) and its committed heads (hf_accel/reference/assets/medusa); prompts are held-out rows of
the reference corpus. At each concurrency every engine (plain; the heads under the default rule; the heads with a
fixed number of candidates and no batch limit, to show where speculation stops paying) generates greedily for the
same prompts, interleaved round by round after one warm-up round, with `ignore_eos` so every request makes the
same number of tokens (single stream: a few prompts one after another, so one prompt's acceptance does not decide).
Reported: output tokens per second of each engine's fastest round (the round least disturbed by other jobs on a
shared machine), the ratio of the fastest rounds to plain's, the range of the per-round ratios, and the mean tokens a
speculating sequence gains per step (1 + accepted candidates per verification); outputs must equal plain.

Regenerate benchmarks/results/bench_engine_medusa.json, docs/bench_engine_medusa.md and the table in docs/serving.md:
    .venv/bin/python benchmarks/bench_engine_medusa.py        (--quick: 1 and 2 requests, 16 tokens, prints only)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from hf_accel import Engine, EngineConfig, SamplingParams, SpeculativeConfig, bench, reference
from hf_accel.bench.output import run_benchmark
from hf_accel.display import format_table
from hf_accel.engine.spec_decode.speculative_config import DEFAULT_MAX_SPECULATIVE_BATCH_TOKENS
from hf_accel.training.medusa_command import REFERENCE_HEADS_DIR
from hf_accel.speculative.medusa_heads import MedusaHeads

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_engine_medusa.py"
FULL = {"concurrency": [1, 4, 8, 16], "rounds": 3, "prompt_len": 64, "new_tokens": 48, "fixed_k": [1, 2],
        "single_stream_prompts": 4}
QUICK = {"concurrency": [1, 2], "rounds": 1, "prompt_len": 32, "new_tokens": 16, "fixed_k": [2],
         "single_stream_prompts": 2}
PLAIN, DEFAULT = "plain", "heads, default rule"


def engines(model, tokenizer, heads, concurrency: int, fixed_k: list[int]) -> dict[str, Engine]:
    """Plain, the default rule, and each fixed k with room for every sequence to speculate."""
    config = EngineConfig(max_num_seqs=max(concurrency, 1), enable_prefix_caching=False)
    built = {PLAIN: Engine(model, tokenizer, config=config),
             DEFAULT: Engine(model, tokenizer, config=config, speculative=SpeculativeConfig("medusa", model=heads))}
    for k in fixed_k:
        always = SpeculativeConfig("medusa", model=heads, num_speculative_tokens=k,
                                   max_speculative_batch_tokens=concurrency * (1 + k))
        built[f"heads, k={k} always"] = Engine(model, tokenizer, config=config, speculative=always)
    return built


def run_concurrency(model, tokenizer, heads, groups: list[list[list[int]]], plan: dict[str, Any]) -> dict[str, Any]:
    """Interleaved rounds over every engine, each generating for the prompt `groups` one group after another (a
    group's prompts concurrently); round 0 is a warm-up."""
    built = engines(model, tokenizer, heads, len(groups[0]), plan["fixed_k"])
    params = SamplingParams(max_tokens=plan["new_tokens"], temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in built}
    expected = None
    for round_index in range(plan["rounds"] + 1):
        for name, engine in built.items():
            started = time.perf_counter()
            tokens = [out.token_ids for group in groups for out in engine.generate(group, params)]
            elapsed = time.perf_counter() - started
            expected = tokens if expected is None else expected
            assert tokens == expected, f"{name}: outputs differ from plain greedy"
            if round_index:
                times[name].append(elapsed)
    total = sum(len(group) for group in groups) * plan["new_tokens"]
    plain = min(times[PLAIN])
    result = {}
    for name, engine in built.items():
        stats = engine.stats()
        best = min(times[name])
        drafts = stats.spec_decode_num_drafts
        gained = 1 + stats.spec_decode_num_accepted_tokens / drafts if drafts else None
        result[name] = {
            "tokens_per_s": round(total / best, 1),
            "ratio_to_plain": round(plain / best, 3),
            "ratio_range": [round(min(p / t for p, t in zip(times[PLAIN], times[name])), 3),
                            round(max(p / t for p, t in zip(times[PLAIN], times[name])), 3)],
            "mean_tokens_per_speculating_step": None if gained is None else round(gained, 3),
            "speculating_share_of_sequence_steps": round(
                stats.spec_decode_num_drafts / max(stats.generation_tokens - stats.spec_decode_num_accepted_tokens, 1),
                3),
            "acceptance_rate": round(stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens, 3)
            if stats.spec_decode_num_draft_tokens else None,
        }
    return result


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    model, tokenizer = reference.load("target")
    heads = MedusaHeads.from_pretrained(REFERENCE_HEADS_DIR, dtype=torch.float32)
    rows = reference.held_out_sequences(tokenizer, seq_len=plan["prompt_len"], max_rows=max(plan["concurrency"]) * 3)
    prompts = [row.tolist() for row in rows[::3]]
    single = [[prompt] for prompt in prompts[: plan["single_stream_prompts"]]]
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "model": "hf_accel reference target, fp32; heads: hf_accel/reference/assets/medusa (4 heads)",
        "hardware": bench.hardware(),
        "settings": {**plan, "default_rule": {"num_speculative_tokens": "every head (4)",
                                              "max_speculative_batch_tokens": DEFAULT_MAX_SPECULATIVE_BATCH_TOKENS}},
        "results": {str(c): run_concurrency(model, tokenizer, heads, single if c == 1 else [prompts[:c]], plan)
                    for c in plan["concurrency"]},
    }


def headline(report: dict[str, Any]) -> str:
    """Plain vs the default rule at each concurrency, for docs/serving.md."""
    s = report["settings"]
    rows = []
    for concurrency, results in report["results"].items():
        plain, medusa = results[PLAIN], results[DEFAULT]
        gained = medusa["mean_tokens_per_speculating_step"]
        rows.append([concurrency, f"{plain['tokens_per_s']:.1f}", f"{medusa['tokens_per_s']:.1f}",
                     f"{medusa['ratio_to_plain']:.2f}x", "-" if gained is None else f"{gained:.2f}",
                     f"{medusa['speculating_share_of_sequence_steps']:.0%}"])
    rule = s["default_rule"]
    return "\n".join([
        f"Reference target (fp32) with its committed Medusa heads, {s['prompt_len']}-token held-out prompts, "
        f"{s['new_tokens']} greedy tokens each (single stream: {s['single_stream_prompts']} prompts one after "
        f"another), {s['rounds']} interleaved rounds after a warm-up (tok/s and ratio: each engine's fastest round), "
        f"{report['hardware']['torch_threads']} torch thread(s) of a shared CPU; default rule: "
        f"`max_speculative_batch_tokens={rule['max_speculative_batch_tokens']}`, up to 4 candidates. From "
        f"`{COMMAND}`; all numbers: [bench_engine_medusa.md](bench_engine_medusa.md).", "",
        format_table(["concurrent requests", "plain tok/s", "with heads tok/s", "ratio",
                            "tokens per speculating step", "sequence steps speculating"], rows, markdown=True), "",
    ])


def markdown(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    rows = []
    for concurrency, results in report["results"].items():
        for name, r in results.items():
            gained = r["mean_tokens_per_speculating_step"]
            rows.append([concurrency, name, f"{r['tokens_per_s']:.1f}",
                         f"{r['ratio_to_plain']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})",
                         "-" if gained is None else f"{gained:.2f}",
                         "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"])
    return "\n".join([
        "# Engine Medusa benchmark", "", f"Regenerate with `{COMMAND}` (`--quick` for a smoke run).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, transformers "
        f"{hw['transformers']}; the machine was shared with other jobs, so compare ratios, not absolutes",
        f"- {report['model']}", "", headline(report), "",
        "Every engine (ratio: plain's fastest round / the engine's fastest round, with the range of per-round "
        "ratios):", "",
        format_table(["concurrent", "engine", "tok/s", "ratio to plain", "tokens per speculating step",
                            "candidates accepted"], rows, markdown=True), "",
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], "bench_engine_medusa", ROOT, measure,
                                      markdown, lambda report: {"docs/serving.md": headline(report)})


if __name__ == "__main__":
    main(sys.argv[1:])
