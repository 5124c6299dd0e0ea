"""`hf-accel` command.

`hf-accel bench`: decode speed, KV memory and greedy agreement of every strategy in `hf_accel.bench.STRATEGIES`
against transformers' DynamicCache, measured in one process, on hf_accel's reference target by default.
`hf-accel train-reference`: train the reference models from scratch (see `hf_accel.reference.train`).
`hf-accel train-medusa`: train Medusa heads for a model (see `hf_accel.medusa_training.command`).
`hf-accel serve`: the OpenAI-compatible HTTP server (extra `serve`; see `hf_accel.server.command`).
`hf-accel export`: write a model for vLLM (see `hf_accel.export.command`).
`hf-accel finetune`: LoRA fine-tune, Medusa heads, quantize, check; a folder to serve (see `hf_accel.finetune.command`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


from . import bench


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= `minimum`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("bench", help="compare cache strategies on one model (same process, interleaved)")
    run.add_argument("--model", default=None,
                     help="local path or hub id of a causal LM (default: hf_accel's reference target)")
    run.add_argument("--draft", default=None,
                     help="local path or hub id of a draft model for the assisted-decoding row (default: the "
                          "reference draft with the reference target)")
    run.add_argument("--prompt-len", type=at_least(1), default=256,
                     help="longest prompt in tokens; with batch > 1, rows range from half of it to all of it, "
                          "left-padded (default: %(default)s)")
    run.add_argument("--new-tokens", type=at_least(2), default=64,
                     help="tokens generated per row, at least 2 (default: %(default)s)")
    run.add_argument("--batch-size", type=at_least(1), default=4, help="rows per generate call (default: %(default)s)")
    run.add_argument("--repeats", type=at_least(1), default=5,
                     help="measured repeats after one warm-up (default: %(default)s)")
    run.add_argument("--threads", type=at_least(1), default=1,
                     help="torch CPU threads; 1 keeps timings stable on a shared machine (default: %(default)s)")
    run.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    run.set_defaults(handler=bench_command)
    train = commands.add_parser("train-reference", add_help=False,
                                help="train the reference target and draft from scratch (--help for options)")
    train.set_defaults(handler=train_reference_command)
    medusa = commands.add_parser("train-medusa", add_help=False,
                                 help="train Medusa heads for a model (default: the reference target; --help)")
    medusa.set_defaults(handler=train_medusa_command)
    serve = commands.add_parser("serve", add_help=False,
                                help="OpenAI-compatible HTTP server (default: the reference target; --help)")
    serve.set_defaults(handler=serve_command)
    export = commands.add_parser("export", add_help=False,
                                 help="write a model (default: the reference target) for vLLM (--help for options)")
    export.set_defaults(handler=export_command)
    finetune = commands.add_parser("finetune", add_help=False,
                                   help="LoRA fine-tune, Medusa heads, quantize, check: a folder to serve (--help)")
    finetune.set_defaults(handler=finetune_command)
    return parser


def train_reference_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """`hf-accel train-reference [options]`: the options are `hf_accel.reference.train`'s."""
    from .reference import train  # imported on demand: training code is not needed to benchmark

    return train.main(list(extra))


def train_medusa_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """`hf-accel train-medusa [options]`: the options are `hf_accel.medusa_training.command`'s."""
    from .medusa_training import command as medusa_command  # imported on demand, like train-reference

    return medusa_command.main(list(extra))


def serve_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """`hf-accel serve [options]`: the options are `hf_accel.server.command`'s."""
    from .server import command  # imported on demand: the server needs the `serve` extra

    return command.main(list(extra))


def export_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """`hf-accel export [options] OUT`: the options are `hf_accel.export.command`'s."""
    from .export import command  # imported on demand, like train-reference

    return command.main(list(extra))


def finetune_command(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """`hf-accel finetune --out OUT [options]`: the options are `hf_accel.finetune.command`'s."""
    from .finetune import command  # imported on demand: fine-tuning needs the `finetune` extra

    return command.main(list(extra))


def prompt_lengths(longest: int, batch_size: int) -> list[int]:
    """Lengths evenly spread from `longest // 2` to `longest` (just `[longest]` for one row)."""
    if batch_size == 1:
        return [longest]
    shortest = max(longest // 2, 1)
    return [shortest + (longest - shortest) * row // (batch_size - 1) for row in range(batch_size)]


def bench_inputs(loaded: bench.BenchModel, lengths: list[int]) -> dict[str, Any]:
    """Held-out text prompts when the model has a tokenizer, else random token ids."""
    if loaded.tokenizer is not None:
        return bench.text_prompts(loaded.tokenizer, lengths)
    pad = loaded.model.generation_config.pad_token_id
    return bench.make_prompts(lengths, loaded.model.config.vocab_size, pad_token_id=0 if pad is None else int(pad))


def bench_command(args: argparse.Namespace, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run the comparison, print the table, return the report (also written to `args.json` when set)."""
    loaded = bench.load_bench_model(args.model, args.draft)
    model = loaded.model
    lengths = prompt_lengths(args.prompt_len, args.batch_size)
    inputs = bench_inputs(loaded, lengths)
    strategies, notes = bench.strategies_for(loaded, args.batch_size)
    with bench.torch_threads(args.threads):  # compare_strategies shows a tqdm bar over the runs
        results = bench.compare_strategies(model, inputs, args.new_tokens, strategies, repeats=args.repeats, warmup=1)
        hardware = bench.hardware()
    report = {
        "model": loaded.description,
        "prompts": "held-out standard-library text" if loaded.tokenizer is not None else "random token ids",
        "notes": notes,
        "hardware": hardware,
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


def render_report(report: dict[str, Any], results: Sequence[bench.StrategyResult]) -> str:
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
        bench.results_table(results),
        *report["notes"],
    ])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hf-accel` console script."""
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.command not in ("train-reference", "train-medusa", "serve", "export", "finetune"):
        build_parser().parse_args(argv)  # reports the unknown options and exits
    result = args.handler(args, extra)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
