"""`hf-accel` command: it only dispatches; each subcommand owns its options in its package (`--help` after it).

`hf-accel bench`: decode speed, KV memory and greedy agreement of every strategy in `hf_accel.bench.STRATEGIES`
against transformers' DynamicCache, measured in one process, on hf_accel's reference target by default (see
`hf_accel.bench.command`).
`hf-accel train-reference`: train the reference models from scratch (see `hf_accel.training.reference_command`).
`hf-accel train-medusa`: train Medusa heads for a model (see `hf_accel.training.medusa_command`).
`hf-accel train-eagle`: train an EAGLE head for a model (see `hf_accel.training.eagle_command`).
`hf-accel serve`: the OpenAI-compatible HTTP server (extra `serve`; see `hf_accel.server.command`).
`hf-accel export`: write a model for vLLM (see `hf_accel.export.command`).
`hf-accel finetune`: LoRA fine-tune, Medusa heads, quantize, check; a folder to serve (see
`hf_accel.training.finetune_command`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module whose `main(argv) -> int` runs it, imported on demand; the help line `hf-accel --help` shows)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("hf_accel.bench.command", "compare cache strategies on one model (same process, interleaved)"),
    "train-reference": ("hf_accel.training.reference_command",
                        "train the reference target and draft from scratch (--help for options)"),
    "train-medusa": ("hf_accel.training.medusa_command",
                     "train Medusa heads for a model (default: the reference target; --help)"),
    "train-eagle": ("hf_accel.training.eagle_command",
                    "train an EAGLE draft head for a model (default: the reference target; --help)"),
    "serve": ("hf_accel.server.command", "OpenAI-compatible HTTP server (default: the reference target; --help)"),
    "export": ("hf_accel.export.command",
               "write a model (default: the reference target) for vLLM (--help for options)"),
    "finetune": ("hf_accel.training.finetune_command",
                 "LoRA fine-tune, Medusa heads, quantize, check: a folder to serve (--help)"),
}


def build_parser() -> argparse.ArgumentParser:
    """`hf-accel SUBCOMMAND ...`: everything after the subcommand goes to that subcommand's own parser."""
    parser = argparse.ArgumentParser(prog="hf-accel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_line) in SUBCOMMANDS.items():
        commands.add_parser(name, add_help=False, help=help_line)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hf-accel` console script; returns the subcommand's exit status."""
    args, rest = build_parser().parse_known_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])  # on demand: serve and finetune need extras
    return module.main(list(rest))


if __name__ == "__main__":
    sys.exit(main())
