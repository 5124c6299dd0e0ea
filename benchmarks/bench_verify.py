"""What a speculative verify costs at real size: the forward of k tokens against the forward of one, on quantized
weights, where a decode step is bound by reading the weights and k rows should cost little more than one.

Measured on the 755M random-weight Llama of bench_size.py (int4 in groups of 64, the default, and of 32, Q4_0's; int8
per channel; fp32 for contrast), batch 1, after a 128-token held-out prefill into a `DynamicCache`: the eager forward
of 1 token and of k = 2, 3, 5 and 8 tokens at the next positions, the cache cut back to the prefill after each call
(as after a verify that rejects every draft), with the float Linears over packed panels as hf_accel's speculative
loops run them (`packed_linears`: the fp32 output layer of the quantized models; MKL's sgemm at a few rows would cost
2x its one-row time). Eager, so each forward carries the same Python overhead (about 5 ms at this size; a compiled
step does not): the ratios are the weights' and attention's own, slightly flattered. Each repeat times every k as the
mean of a few calls, in alternating order, after a warm-up round; one format at a time; the ratio is the median of
per-repeat ratios t(k) / t(1). The int4 models are also timed through the compiled steps that `generate(...,
compile_config=...)`'s speculative loops run (paged cache, hf_accel's paged attention, no Python between ops:
`hf_accel.bench.compiled_costs.verify_cost`): a decode step against a verify of 1 + 4 and 1 + 8 tokens.

Regenerate benchmarks/results/bench_verify.json and docs/bench_verify.md:
    .venv/bin/python benchmarks/bench_verify.py
Smoke run (a tiny model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_verify.py --quick
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

import hf_accel
from hf_accel import reference
from hf_accel.bench.compiled_costs import verify_cost
from hf_accel.bench.output import hardware, run_benchmark, target_table
from hf_accel.bench.timing import torch_threads
from hf_accel.kernels.eager_packing import packed_linears

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_size  # noqa: E402
from bench_weight_quant import reference_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_verify"
COMMAND = ".venv/bin/python benchmarks/bench_verify.py"
FORMATS = {"int4 g64": hf_accel.WeightOnlyConfig(bits=4), "int4 g32": hf_accel.WeightOnlyConfig(bits=4, group_size=32),
           "int8": hf_accel.WeightOnlyConfig(bits=8), "fp32": None}
TOKENS = (1, 2, 3, 5, 8)
TARGET = {"formats": ("int4 g64", "int4 g32"), "tokens": 5, "goal": 1.2}  # a 5-token verify <= 1.2x one token
FULL = {"size": bench_size.FULL.sizes[-1], "threads": (1, 2), "prefill": 128, "calls": 3, "repeats": 9,
        "compiled_repeats": 9}
QUICK = {"size": bench_size.QUICK.sizes[-1], "threads": (1,), "prefill": 16, "calls": 2, "repeats": 1,
         "compiled_repeats": 1}


class Verifier:
    """A model and its `DynamicCache` holding the prefill, cut back to it after every call."""

    def __init__(self, model: torch.nn.Module, prompt: torch.Tensor) -> None:
        self.model, self.prefill = model, prompt.shape[1]
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(prompt, past_key_values=self.cache, use_cache=True)
        self.tokens = {k: prompt[:, :k].clone() for k in TOKENS}

    def seconds(self, k: int, calls: int) -> float:
        """Mean seconds of a k-token forward after the prefill."""
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(calls):
                self.model(self.tokens[k], past_key_values=self.cache, use_cache=True)
                self.cache.crop(-k)  # transformers 5: a negative count of tokens to drop
        return (time.perf_counter() - start) / calls


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    started = time.perf_counter()
    prompt = reference.held_out_sequences(reference_tokenizer(), plan["prefill"], max_rows=1)
    rows, compiled = [], []
    with tempfile.TemporaryDirectory() as scratch:
        folder = bench_size.model_folder(plan["size"], Path(scratch) / "model")
        models = {fmt: hf_accel.load_model(str(folder), quant=config, dtype=torch.float32).eval()
                  for fmt, config in FORMATS.items()}
        parameters = sum(p.numel() for p in models["fp32"].parameters())
        for threads in plan["threads"]:
            for fmt, model in models.items():
                with torch_threads(threads), torch.no_grad(), packed_linears(model):
                    per_k = _interleaved(Verifier(model, prompt), plan)
                for k in TOKENS:
                    ratios = [t / one for t, one in zip(per_k[k], per_k[1])]
                    rows.append({"format": fmt, "threads": threads, "tokens": k,
                                 "ms": 1000 * statistics.median(per_k[k]), "vs_one_token": statistics.median(ratios)})
                if fmt in TARGET["formats"]:  # also through the compiled steps (about a minute each to compile)
                    with torch_threads(threads):
                        compiled.append({"format": fmt, "threads": threads,
                                         **verify_cost(model, plan["prefill"], plan["compiled_repeats"])})
                gc.collect()
    report = {"command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(), "size": plan["size"].name,
              "parameters": parameters, "prefill": plan["prefill"], "repeats": plan["repeats"], "rows": rows,
              "compiled": compiled, "total_seconds": time.perf_counter() - started}
    report["targets"] = targets(report)
    return report


def _interleaved(verifier: Verifier, plan: dict[str, Any]) -> dict[int, list[float]]:
    """Seconds per token count and repeat, token counts in alternating order, after a warm-up round."""
    times: dict[int, list[float]] = {k: [] for k in TOKENS}
    for repeat in range(1 + plan["repeats"]):
        for k in TOKENS if repeat % 2 == 0 else TOKENS[::-1]:
            elapsed = verifier.seconds(k, plan["calls"])
            if repeat:
                times[k].append(elapsed)
    return times


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for row in report["rows"]:
        if row["format"] in TARGET["formats"] and row["tokens"] == TARGET["tokens"]:
            threads = row["threads"]
            found.append(_target(f"{row['format']}, eager", threads, row["vs_one_token"]))
    for row in report.get("compiled", []):
        if row["format"] in TARGET["formats"]:
            found.append(_target(f"{row['format']}, compiled", row["threads"], row["verify_5_over_decode"]))
    return found


def _target(what: str, threads: int, value: float) -> dict[str, Any]:
    return {"name": f"{TARGET['tokens']}-token verify / 1-token decode, {what} ({threads} thread{'s' * (threads > 1)})",
            "goal": f"<= {TARGET['goal']}", "value": value, "met": value <= TARGET["goal"]}


def render(report: dict[str, Any]) -> str:
    lines = ["# Verify cost at real size: a forward of k tokens against one", "",
             f"{report['hardware']['cpu']}; {report['size']} ({report['parameters'] / 1e6:.0f}M parameters), batch 1, "
             f"{report['prefill']}-token prefill in `DynamicCache`, eager forward (float Linears over panels), "
             f"median of {report['repeats']} interleaved repeats.", "",
             "| weights | threads | " + " | ".join(f"{k} tok (ms, x one)" for k in TOKENS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in TOKENS) + " |"]
    keys = sorted({(row["format"], row["threads"]) for row in report["rows"]}, key=lambda key: (key[1], key[0]))
    for fmt, threads in keys:
        cells = {row["tokens"]: row for row in report["rows"] if row["format"] == fmt and row["threads"] == threads}
        lines.append(f"| {fmt} | {threads} | " + " | ".join(
            f"{cells[k]['ms']:.1f}, {cells[k]['vs_one_token']:.2f}x" for k in TOKENS) + " |")
    lines += _compiled_table(report.get("compiled", [])) + [""] + target_table(report["targets"])
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def _compiled_table(rows: list[dict[str, Any]]) -> list[str]:
    """The compiled steps' rows (`verify_cost`: paged cache, hf_accel's attention, no Python between ops)."""
    if not rows:
        return []
    lines = ["", "Compiled, as `generate(..., compile_config=...)`'s speculative loops run them (paged cache, "
             "hf_accel's paged attention; `hf_accel.bench.compiled_costs.verify_cost`, median of interleaved "
             "repeats of 20 calls):", "",
             "| weights | threads | decode step (ms) | 1 + 4 tokens (ms, x decode) | 1 + 8 tokens (ms, x decode) |",
             "| --- | --- | --- | --- | --- |"]
    for row in sorted(rows, key=lambda row: (row["threads"], row["format"])):
        lines.append(f"| {row['format']} | {row['threads']} | {row['decode_ms']:.1f} | {row['verify_5_ms']:.1f}, "
                     f"{row['verify_5_over_decode']:.2f}x | {row['verify_9_ms']:.1f}, "
                     f"{row['verify_9_over_decode']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    description = __doc__.split("\n\n")[0]
    return run_benchmark(argv, description, NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
