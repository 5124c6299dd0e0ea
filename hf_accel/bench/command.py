"""`hf-accel bench`: what hf_accel buys on one model, measured in one process: the stock options a user would reach
for (eager `DynamicCache`, the baseline; `StaticCache` + `compile_config`, transformers' fastest on CPU) beside
hf_accel's best per feature (compiled caches, EAGLE and n-gram speculation, the Engine, int8 / int4 weights:
`main_rows`), each with its speed ratios, K/V bytes, greedy agreement and a one-line verdict; on hf_accel's reference
target by default.

    hf-accel bench                                  # the reference target, batch 1, prompts of 256 tokens
    hf-accel bench --quick                          # one row per kind, shorter runs: about a minute once cached
    hf-accel bench --batch-size 4 --json out.json   # left-padded batches; writes the report too
    hf-accel bench --draft PATH                     # adds draft-model rows (and stock assisted decoding at batch 1)
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..arguments import at_least
from ..kernels.custom_ops import paged_attention_kernel
from ..speculative.draft import draft_generate
from .inputs import bench_prompts, prompt_lengths
from .main_rows import PAGED, STOCK_BEST, main_rows, row
from .models import load_bench_model
from .output import hardware
from .results import StrategyResult, kv_bytes, results_table
from .strategies import Strategy
from .timing import compare_strategies, run_generate, torch_threads
from .verdicts import verdicts


FULL = {"prompt_len": 256, "new_tokens": 64, "repeats": 5}
QUICK = {"prompt_len": 128, "new_tokens": 32, "repeats": 3}


def build_parser() -> argparse.ArgumentParser:
    """Options of `hf-accel bench`."""
    parser = argparse.ArgumentParser(prog="hf-accel bench")
    parser.add_argument("--model", default=None,
                        help="local path or hub id of a causal LM, or a GGUF file (Q8_0 / Q4_0 kept packed) "
                             "(default: hf_accel's reference target)")
    parser.add_argument("--draft", default=None,
                        help="local path or hub id of a draft model: adds hf_accel's draft-model rows (and at batch "
                             "size 1 transformers' assisted decoding)")
    parser.add_argument("--quick", action="store_true",
                        help=f"one row per kind and shorter runs (prompts {QUICK['prompt_len']}, "
                             f"{QUICK['new_tokens']} new tokens, {QUICK['repeats']} repeats)")
    parser.add_argument("--prompt-len", type=at_least(1), default=None,
                        help="longest prompt in tokens; with batch > 1, rows range from half of it to all of it, "
                             f"left-padded (default: {FULL['prompt_len']})")
    parser.add_argument("--new-tokens", type=at_least(2), default=None,
                        help=f"tokens generated per row, at least 2 (default: {FULL['new_tokens']})")
    parser.add_argument("--batch-size", type=at_least(1), default=1,
                        help="rows per generate call (default: %(default)s)")
    parser.add_argument("--repeats", type=at_least(1), default=None,
                        help=f"measured repeats after one warm-up (default: {FULL['repeats']})")
    parser.add_argument("--threads", type=at_least(1), default=1,
                        help="torch CPU threads; 1 keeps timings stable on a shared machine (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel bench`; returns the exit status."""
    args = build_parser().parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    run_bench(args)
    return 0


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison, print the table and verdicts, return the report (also written to `args.json`)."""
    # hf_accel's C++ kernels build (first run only) on the other core while the model loads and the stock rows warm up
    threading.Thread(target=paged_attention_kernel, name="hf_accel-kernel-build", daemon=True).start()
    loaded = load_bench_model(args.model, args.draft)
    model = loaded.model
    lengths = prompt_lengths(args.prompt_len, args.batch_size)
    inputs = bench_prompts(loaded, lengths)
    strategies, notes = main_rows(loaded, args.quick)
    strategies += draft_rows(loaded.draft if args.draft is not None else None, args.batch_size)
    failures: list[str] = []  # a row that cannot run on this model is reported, not fatal

    def failed(name: str, error: Exception) -> None:
        failures.append(f"left out: {name} failed on this model ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''})")

    with torch_threads(args.threads):  # compare_strategies shows a tqdm bar over the runs
        results = compare_strategies(model, inputs, args.new_tokens, strategies, repeats=args.repeats, warmup=1,
                                     on_error=failed)
        ran = {r.name for r in results}
        strategies = tuple(s for s in strategies if s.name in ran)
        fill_kv_bytes(model, inputs, args.new_tokens, strategies, results)
        machine = hardware()
    report = {
        "model": loaded.description,
        "prompts": "held-out standard-library text" if loaded.tokenizer is not None else "random token ids",
        "notes": notes + failures,
        "hardware": machine,
        "settings": {"dtype": str(model.dtype), "batch_size": args.batch_size, "prompt_lengths": lengths,
                     "new_tokens": args.new_tokens, "repeats": args.repeats, "warmup": 1, "quick": args.quick},
        "strategies": {s.name: s.description for s in strategies},
        "results": [r.as_dict() for r in results],
        "verdicts": verdicts(strategies, results, STOCK_BEST),
    }
    print(render_report(report, results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def draft_rows(draft: PreTrainedModel | None, batch_size: int) -> tuple[Strategy, ...]:
    """hf_accel's draft-model decoding with `draft` and, at batch size 1, stock assisted decoding (none without)."""
    if draft is None:
        return ()
    rows = (row("hf_accel draft", "custom_generate=hf_accel.draft_generate, draft_model=the draft, paged cache",
                lambda m, n: {**PAGED, "custom_generate": draft_generate, "draft_model": draft}),)
    if batch_size == 1:
        rows += (row("transformers assisted (draft)", "stock assisted decoding, assistant_model=the draft",
                     lambda m, n: {"assistant_model": draft}),)
    return rows


def fill_kv_bytes(model: PreTrainedModel, inputs: dict[str, torch.Tensor], new_tokens: int,
                  strategies: Sequence[Strategy], results: Sequence[StrategyResult]) -> None:
    """K/V bytes of the rows that return no cache but name a run whose cache holds the same (`kv_kwargs`): one
    untimed run each, compared with the baseline's bytes."""
    base = results[0].kv_bytes
    for strategy, result in zip(strategies, results):
        if result.kv_bytes is None and strategy.kv_kwargs is not None:
            probe = Strategy(strategy.name, "", strategy.kv_kwargs)
            result.kv_bytes = kv_bytes(run_generate(model, inputs, probe, new_tokens)[1].past_key_values)
            result.kv_ratio = None if result.kv_bytes is None or not base else result.kv_bytes / base


def render_report(report: dict[str, Any], results: Sequence[StrategyResult]) -> str:
    """The lines `hf-accel bench` prints: model, hardware, settings, the timing rule, the table, the verdicts, then
    the notes."""
    hw, settings = report["hardware"], report["settings"]
    lengths = settings["prompt_lengths"]
    prompts = f"{lengths[0]}" if len(set(lengths)) == 1 else f"{min(lengths)}-{max(lengths)} (left-padded)"
    return "\n".join([
        f"model: {report['model']}",
        f"hardware: {hw['cpu']}, {hw['torch_threads']} torch thread(s); torch {hw['torch']}, "
        f"transformers {hw['transformers']}",
        f"{settings['dtype']}, batch {settings['batch_size']}, prompts of {prompts} tokens ({report['prompts']}), "
        f"{settings['new_tokens']} "
        f"new tokens, greedy, EOS off; median of {settings['repeats']} interleaved repeats after "
        f"{settings['warmup']} warm-up (which also builds kernels and compiles)",
        "decode tok/s = rows * (new tokens - 1) / (time(new tokens) - time(1 token)): prefill excluded; "
        "paired = median of per-repeat ratios",
        "",
        results_table(results),
        "",
        *(f"- {line}" for line in report["verdicts"]),
        *report["notes"],
    ])
