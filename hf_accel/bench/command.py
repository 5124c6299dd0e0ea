"""`hf-accel bench`: decode speed, KV memory and greedy agreement of every strategy in `hf_accel.bench.STRATEGIES`
(plus the engine and the speculative rows the model has what for: `strategies_for`) against transformers'
DynamicCache, measured in one process, on hf_accel's reference target by default.

    hf-accel bench                                  # the reference target, batch 4, prompts of 128-256 tokens
    hf-accel bench --batch-size 1 --json out.json   # adds stock assisted decoding; writes the report too
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..arguments import at_least
from .inputs import bench_prompts, prompt_lengths
from .models import load_bench_model
from .output import hardware
from .results import StrategyResult, results_table
from .strategies import strategies_for
from .timing import compare_strategies, torch_threads


def build_parser() -> argparse.ArgumentParser:
    """Options of `hf-accel bench`."""
    parser = argparse.ArgumentParser(prog="hf-accel bench")
    parser.add_argument("--model", default=None,
                        help="local path or hub id of a causal LM (default: hf_accel's reference target)")
    parser.add_argument("--draft", default=None,
                        help="local path or hub id of a draft model for the assisted-decoding row (default: the "
                             "reference draft with the reference target)")
    parser.add_argument("--prompt-len", type=at_least(1), default=256,
                        help="longest prompt in tokens; with batch > 1, rows range from half of it to all of it, "
                             "left-padded (default: %(default)s)")
    parser.add_argument("--new-tokens", type=at_least(2), default=64,
                        help="tokens generated per row, at least 2 (default: %(default)s)")
    parser.add_argument("--batch-size", type=at_least(1), default=4,
                        help="rows per generate call (default: %(default)s)")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="measured repeats after one warm-up (default: %(default)s)")
    parser.add_argument("--threads", type=at_least(1), default=1,
                        help="torch CPU threads; 1 keeps timings stable on a shared machine (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel bench`; returns the exit status."""
    run_bench(build_parser().parse_args(argv))
    return 0


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison, print the table, return the report (also written to `args.json` when set)."""
    loaded = load_bench_model(args.model, args.draft)
    model = loaded.model
    lengths = prompt_lengths(args.prompt_len, args.batch_size)
    inputs = bench_prompts(loaded, lengths)
    strategies, notes = strategies_for(loaded, args.batch_size)
    with torch_threads(args.threads):  # compare_strategies shows a tqdm bar over the runs
        results = compare_strategies(model, inputs, args.new_tokens, strategies, repeats=args.repeats, warmup=1)
        machine = hardware()
    report = {
        "model": loaded.description,
        "prompts": "held-out standard-library text" if loaded.tokenizer is not None else "random token ids",
        "notes": notes,
        "hardware": machine,
        "settings": {"dtype": str(model.dtype), "batch_size": args.batch_size, "prompt_lengths": lengths,
                     "new_tokens": args.new_tokens, "repeats": args.repeats, "warmup": 1},
        "strategies": {s.name: s.description for s in strategies},
        "results": [r.as_dict() for r in results],
    }
    print(render_report(report, results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def render_report(report: dict[str, Any], results: Sequence[StrategyResult]) -> str:
    """The lines `hf-accel bench` prints: model, hardware, settings, the timing rule, the table, then the notes."""
    hw, settings = report["hardware"], report["settings"]
    lengths = settings["prompt_lengths"]
    prompts = f"{lengths[0]}" if len(set(lengths)) == 1 else f"{min(lengths)}-{max(lengths)} (left-padded)"
    return "\n".join([
        f"model: {report['model']}",
        f"hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s); torch {hw['torch']}, "
        f"transformers {hw['transformers']}",
        f"{settings['dtype']}, batch {settings['batch_size']}, prompts of {prompts} tokens ({report['prompts']}), "
        f"{settings['new_tokens']} "
        f"new tokens, greedy; median of {settings['repeats']} interleaved repeats after {settings['warmup']} warm-up",
        "decode tok/s = rows * (new tokens - 1) / (time(new tokens) - time(1 token)): prefill excluded; "
        "paired = median of per-repeat ratios",
        "",
        results_table(results),
        *report["notes"],
    ])
