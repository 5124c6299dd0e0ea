"""Fine-tune, then serve, measured: `hf-accel finetune`'s default path on the reference target (LoRA on the installed
distributions' descriptions, merge, Medusa heads by self-distillation, int8 weights), each stage's held-out
perplexity, greedy agreement with the float model and decode speed against plain `generate`, in one process.

Regenerate benchmarks/results/bench_finetune.json and docs/bench_finetune.md (22 minutes on one core of the loaded shared machine):
    .venv/bin/python benchmarks/bench_finetune.py
Smoke run (a few steps of each stage, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_finetune.py --quick
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from hf_accel import reference
from hf_accel.bench.output import run_benchmark
from hf_accel.training.finetune import FinetuneConfig, run_finetune
from hf_accel.training.finetune_domain import domain_splits
from hf_accel.training.finetune_report import report_markdown
from hf_accel.training.lora import LoraSettings

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_finetune"
COMMAND = ".venv/bin/python benchmarks/bench_finetune.py"
QUICK = FinetuneConfig(lora=LoraSettings(steps=4, batch_size=4), medusa_steps=4, medusa_batch_size=4,
                       self_distill_rows=4, eval_rows=4, speed_prompts=1, new_tokens=16, repeats=1)


def measure(quick: bool) -> dict[str, Any]:
    """Run the whole path into a temporary folder; the report is what `hf-accel finetune` writes to report.json."""
    config = QUICK if quick else FinetuneConfig()
    model, tokenizer = reference.load("target")
    original = reference.held_out_sequences(tokenizer, config.seq_len, config.eval_rows)
    heads = reference.load_head("medusa")
    with tempfile.TemporaryDirectory() as out:
        report = run_finetune(model, tokenizer, domain_splits(), out, config, init_heads=heads,
                              original_rows=original, description="hf_accel reference target", progress=False)
    report["command"] = COMMAND + (" --quick" if quick else "")
    return report


def render(report: dict[str, Any]) -> str:
    return f"# Fine-tune, then serve\n\nWritten by `{report['command']}`.\n\n" + report_markdown(report)


def headline(report: dict[str, Any]) -> dict[str, str]:
    """The perplexity and speed tables quoted in docs/finetune-then-serve.md."""
    return {"docs/finetune-then-serve.md": report_markdown(report).rstrip()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render, headline)


if __name__ == "__main__":
    main(sys.argv[1:])
