"""Medusa benchmark: Medusa decoding against plain generate on the reference target, greedy and sampling, batch 1 / 4 / 8.

Prompts are held-out rows of the reference corpus (text neither the model nor the heads trained on). For each
prompt (or batch) and repeat, plain `generate` and `generate(custom_generate=medusa_generate)` run back to back in
the same process (interleaved, one warm-up pair first, both seeded alike); greedy outputs must be token-for-token
equal. Reported per tree at batch 1: new tokens per target forward (the prefill counted as one forward, as plain
decoding makes one token per forward), accepted candidates per step at each depth, candidates verified per step,
and the wall-time ratio plain / Medusa (median of the per-pair ratios, and total plain time over total Medusa time);
then the default (adaptive) and the whole calibrated tree with sampling (temperature 0.7). Then the default tree at
batch 1, 4 and 8: left-padded batches of held-out prompts of mixed lengths (half the prompt length to all of it),
each row equal to plain batched greedy, with the same ratios.

Regenerate benchmarks/results/bench_medusa.json, docs/bench_medusa.md and the table in docs/medusa.md:
    .venv/bin/python benchmarks/bench_medusa.py        (--quick: 2 prompts, 32 tokens, prints only)
    .venv/bin/python benchmarks/bench_medusa.py --batches-only [--batch-sizes 4]   (the batch table alone, prints only)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hf_accel import bench, reference
from hf_accel.bench.output import benchmark_parser, run_benchmark
from hf_accel.display import format_table
from hf_accel.training.medusa_command import REFERENCE_HEADS_DIR
from hf_accel.speculative.medusa import medusa_generate
from hf_accel.speculative.stats import SpeculativeStats
from hf_accel.speculative.medusa_heads import MedusaHeads
from hf_accel.speculative.tree import DEFAULT_TREE, sparse_tree

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/bench_medusa.py"
GREEDY = {"do_sample": False}
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
FULL = {"prompts": 4, "repeats": 2, "prompt_len": 128, "new_tokens": 128}
QUICK = {"prompts": 2, "repeats": 1, "prompt_len": 64, "new_tokens": 32}
FULL_BATCHES = {"batch_sizes": [1, 4, 8], "batches": 4, "prompt_len": 128, "new_tokens": 128}
QUICK_BATCHES = {"batch_sizes": [1, 4], "batches": 1, "prompt_len": 64, "new_tokens": 32}


def trees(heads_dir: Path) -> dict[str, list | None]:
    """The default (adaptive prefixes of the heads' calibrated tree), that tree verified whole, the built-in default
    and a plain chain of top-1 candidates."""
    record = json.loads((heads_dir / "training.json").read_text())
    rates = torch.tensor(record["calibration"]["rank_accuracy_on_own_greedy_output"])
    size = record["calibration"]["tree_size"]
    return {
        f"adaptive prefix of the calibrated {size} (default)": None,
        f"calibrated, {size} candidates, whole": sparse_tree(rates, size),
        f"built-in default, {len(DEFAULT_TREE)} candidates": list(DEFAULT_TREE),
        "chain of top-1s, 4 candidates": [(0,) * depth for depth in range(1, 5)],
    }


def timed(fn) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def run_tree(model, heads, prompts: torch.Tensor, tree, plan: dict[str, int], mode: dict[str, Any]) -> dict:
    """Interleaved plain / Medusa pairs over every prompt, each side seeded alike. Greedy outputs must be equal;
    with sampling the count of equal outputs is reported (equal seeds draw equal tokens up to float rounding)."""
    common = dict(max_new_tokens=plan["new_tokens"], min_new_tokens=plan["new_tokens"], eos_token_id=None, **mode)
    ratios, plain_times, medusa_times, stats, num_equal = [], [], [], SpeculativeStats(), 0
    for index in tqdm(range(-1, prompts.shape[0]), desc="prompts", leave=False):  # index -1: warm-up on the first prompt, not recorded
        prompt = prompts[max(index, 0)][None]
        for repeat in range(1 if index < 0 else plan["repeats"]):
            torch.manual_seed(repeat)
            plain_s, plain = timed(lambda: model.generate(prompt, **common))
            counted = SpeculativeStats() if index < 0 else stats
            torch.manual_seed(repeat)
            medusa_s, medusa = timed(lambda: model.generate(prompt, custom_generate=medusa_generate, medusa_heads=heads,
                                                            medusa_tree=tree, medusa_stats=counted, **common))
            assert mode["do_sample"] or torch.equal(plain, medusa), "Medusa greedy output differs from plain greedy"
            if index >= 0:
                ratios.append(plain_s / medusa_s)
                plain_times.append(plain_s)
                medusa_times.append(medusa_s)
                num_equal += int(torch.equal(plain, medusa))
    return {
        "tokens_per_forward": round(stats.tokens_per_forward, 3),
        "accepted_per_step_by_depth": [round(a / max(stats.num_row_rounds, 1), 3) for a in stats.accepted],
        "speedup_median": round(statistics.median(ratios), 3),
        "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "speedup_total_time": round(sum(plain_times) / sum(medusa_times), 3),
        "candidates_per_step": round(statistics.mean(stats.draft_lengths), 2),
        "plain_tokens_per_s": round(plan["new_tokens"] / statistics.median(plain_times), 1),
        "medusa_tokens_per_s": round(plan["new_tokens"] / statistics.median(medusa_times), 1),
        "outputs_equal_to_plain": f"{num_equal}/{len(ratios)}",
    }


def mixed_batch(rows: torch.Tensor, size: int, index: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Batch `index` of `size` held-out rows, left-padded to prompt lengths spread over half the width to all of it."""
    ids = rows[index * size : (index + 1) * size].clone()
    width = ids.shape[1]
    mask = torch.ones_like(ids)
    for row in range(1, size):  # row 0 keeps the whole width
        mask[row, : (row * 37 + index * 13) % (width // 2)] = 0
    return {"input_ids": ids.masked_fill(mask == 0, pad_token_id), "attention_mask": mask}


def run_batch_size(model, heads, rows: torch.Tensor, size: int, plan: dict[str, Any], pad_token_id: int) -> dict:
    """The default tree at batch `size`: interleaved plain / Medusa pairs over `plan["batches"]` batches (one
    warm-up pair first); every row must equal plain batched greedy."""
    common = dict(max_new_tokens=plan["new_tokens"], min_new_tokens=plan["new_tokens"], eos_token_id=None,
                  pad_token_id=pad_token_id, **GREEDY)
    ratios, plain_times, medusa_times, stats, rows_equal = [], [], [], SpeculativeStats(), 0
    for index in tqdm(range(-1, plan["batches"]), desc=f"batch {size}", leave=False):
        inputs = mixed_batch(rows, size, max(index, 0), pad_token_id)
        plain_s, plain = timed(lambda: model.generate(**inputs, **common))
        counted = SpeculativeStats() if index < 0 else stats
        medusa_s, medusa = timed(lambda: model.generate(**inputs, custom_generate=medusa_generate, medusa_heads=heads,
                                                        medusa_stats=counted, **common))
        equal = [torch.equal(a, b) for a, b in zip(plain, medusa)]
        assert all(equal), f"batch {size}: Medusa rows {[i for i, e in enumerate(equal) if not e]} differ from plain"
        if index >= 0:
            ratios.append(plain_s / medusa_s)
            plain_times.append(plain_s)
            medusa_times.append(medusa_s)
            rows_equal += sum(equal)
    new_tokens = plan["new_tokens"] * size
    return {
        "tokens_per_forward": round(stats.tokens_per_forward, 3),
        "candidates_per_step": round(statistics.mean(stats.draft_lengths), 2),
        "speedup_median": round(statistics.median(ratios), 3),
        "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "speedup_total_time": round(sum(plain_times) / sum(medusa_times), 3),
        "plain_tokens_per_s": round(new_tokens / statistics.median(plain_times), 1),
        "medusa_tokens_per_s": round(new_tokens / statistics.median(medusa_times), 1),
        "rows_equal_to_plain": f"{rows_equal}/{size * len(ratios)}",
    }


def measure(quick: bool) -> dict[str, Any]:
    plan, batch_plan = (QUICK, QUICK_BATCHES) if quick else (FULL, FULL_BATCHES)
    model, tokenizer = reference.load("target")
    heads = MedusaHeads.from_pretrained(REFERENCE_HEADS_DIR, dtype=torch.float32)
    rows = reference.held_out_sequences(tokenizer, seq_len=plan["prompt_len"], max_rows=plan["prompts"] * 7)
    prompts, candidates = rows[::7], trees(REFERENCE_HEADS_DIR)
    greedy = {name: run_tree(model, heads, prompts, tree, plan, GREEDY) for name, tree in candidates.items()}
    sampled = dict(list(candidates.items())[:2])  # the default and the whole calibrated tree
    sampling = {name: run_tree(model, heads, prompts, tree, plan, SAMPLING) for name, tree in sampled.items()}
    batches = measure_batches(model, heads, tokenizer, batch_plan)
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "model": "hf_accel reference target, fp32; heads: hf_accel/reference/assets/medusa",
        "hardware": bench.hardware(),
        "settings": {"batch_size": 1, **plan, "sampling": SAMPLING, "batches": batch_plan},
        "greedy": greedy,
        "sampling": sampling,
        "batch_sizes": batches,
    }


def measure_batches(model, heads, tokenizer, batch_plan: dict[str, Any]) -> dict[str, dict]:
    """The default tree at each of `batch_plan["batch_sizes"]` (see `run_batch_size`)."""
    most = max(batch_plan["batch_sizes"]) * batch_plan["batches"]
    batch_rows = reference.held_out_sequences(tokenizer, seq_len=batch_plan["prompt_len"], max_rows=most * 3)[::3]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {str(size): run_batch_size(model, heads, batch_rows, size, batch_plan, pad)
            for size in batch_plan["batch_sizes"]}


def batch_table(results: dict[str, dict]) -> str:
    rows = [[size, f"{r['candidates_per_step']:.1f}", f"{r['tokens_per_forward']:.2f}",
             f"{r['speedup_median']:.2f}x ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})",
             f"{r['speedup_total_time']:.2f}x", f"{r['plain_tokens_per_s']:.1f}", f"{r['medusa_tokens_per_s']:.1f}",
             r["rows_equal_to_plain"]] for size, r in results.items()]
    headers = ["batch", "candidates per step", "tokens per row per target forward", "speed x plain, median (range)",
               "total time x plain", "plain tok/s", "Medusa tok/s", "rows equal to plain"]
    return format_table(headers, rows, markdown=True)


def tree_table(results: dict[str, dict]) -> str:
    rows = [[name, f"{r['candidates_per_step']:.1f}", f"{r['tokens_per_forward']:.2f}",
             ", ".join(f"{a:.2f}" for a in r["accepted_per_step_by_depth"]),
             f"{r['speedup_median']:.2f}x ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})",
             f"{r['speedup_total_time']:.2f}x", r["outputs_equal_to_plain"]] for name, r in results.items()]
    headers = ["tree", "candidates per step", "tokens per target forward", "accepted per step at depth 1, 2, ...",
               "speed x plain, median (range)", "total time x plain", "outputs equal to plain"]
    return format_table(headers, rows, markdown=True)


def headline(report: dict[str, Any]) -> str:
    """Greedy, sampling and batch tables plus the issues' targets, for docs/medusa.md."""
    s, greedy, batches = report["settings"], report["greedy"], report["batch_sizes"]
    own, whole = list(greedy.values())[:2]  # the default (adaptive) and the calibrated tree verified whole
    fastest = max(greedy, key=lambda name: greedy[name]["speedup_median"])
    most = max(r["tokens_per_forward"] for r in greedy.values())
    plan = s["batches"]
    at_4 = batches.get("4")
    targets = [
        [">= 2.5 tokens per target forward (greedy, issue 6)", f"{whole['tokens_per_forward']:.2f} (calibrated tree, "
         f"whole), {own['tokens_per_forward']:.2f} (default: adaptive, fewer candidates per step)",
         "yes" if most >= 2.5 else "**no**"],
        [">= 2.0x plain (greedy, issue 6)", f"{own['speedup_median']:.2f}x (default), "
         f"{greedy[fastest]['speedup_median']:.2f}x (fastest: {fastest})",
         "yes" if greedy[fastest]["speedup_median"] >= 2.0 else "**no**"],
    ]
    if at_4 is not None:
        targets.append([">= 0.95x plain at batch 4 (greedy, default tree, issue 17)",
                        f"{at_4['speedup_median']:.2f}x median ({at_4['speedup_range'][0]:.2f}-"
                        f"{at_4['speedup_range'][1]:.2f}), {at_4['speedup_total_time']:.2f}x total time",
                        "yes" if at_4["speedup_median"] >= 0.95 else "**no**"])
    return "\n".join([
        f"{s['prompts']} held-out prompts of {s['prompt_len']} tokens x {s['repeats']} repeats, batch 1, "
        f"{s['new_tokens']} new tokens each, reference target in fp32 on {report['hardware']['torch_threads']} torch "
        f"thread(s) of a shared CPU ({report['hardware']['cpu']}); plain and Medusa interleaved and seeded alike. "
        f"From `{COMMAND}`; all numbers: [bench_medusa.md](bench_medusa.md).", "",
        "Greedy:", "", tree_table(greedy), "",
        f"Sampling (temperature {SAMPLING['temperature']}):", "", tree_table(report["sampling"]), "",
        f"Batches (default tree, greedy): {plan['batches']} left-padded batches per size of held-out prompts of "
        f"{plan['prompt_len'] // 2}-{plan['prompt_len']} tokens, {plan['new_tokens']} new tokens per row; tok/s "
        f"counts every row's tokens:", "", batch_table(batches), "",
        format_table(["target", "measured", "met"], targets, markdown=True),
    ])


def markdown(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    return "\n".join([
        "# Medusa benchmark", "", f"Regenerate with `{COMMAND}` (`--quick` for a smoke run).", "",
        f"- hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s), torch {hw['torch']}, transformers "
        f"{hw['transformers']}; the machine was shared with other jobs, so compare ratios, not absolutes",
        f"- {report['model']}", "", headline(report), "",
        "Tokens per second (medians):", "",
        format_table(["mode", "tree", "plain tok/s", "Medusa tok/s"], [
            [mode, name, f"{r['plain_tokens_per_s']:.1f}", f"{r['medusa_tokens_per_s']:.1f}"]
            for mode in ("greedy", "sampling") for name, r in report[mode].items()], markdown=True), "",
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__.split("\n\n")[0], "bench_medusa")
    parser.add_argument("--batches-only", action="store_true",
                        help="only the default tree at batch 1 / 4 / 8 (prints the table, writes nothing)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="with --batches-only: these batch sizes (default 1 4 8)")
    args = parser.parse_args(argv)
    if args.batches_only:
        plan = dict(QUICK_BATCHES if args.quick else FULL_BATCHES)
        plan["batch_sizes"] = args.batch_sizes or plan["batch_sizes"]
        with bench.torch_threads(args.threads):
            model, tokenizer = reference.load("target")
            heads = MedusaHeads.from_pretrained(REFERENCE_HEADS_DIR, dtype=torch.float32)
            results = measure_batches(model, heads, tokenizer, plan)
        print("\n" + batch_table(results))
        return results
    return run_benchmark(argv, __doc__.split("\n\n")[0], "bench_medusa", ROOT, measure, markdown,
                                      lambda report: {"docs/medusa.md": headline(report)})


if __name__ == "__main__":
    main(sys.argv[1:])
