"""The options the training commands share, and what they mean.

Groups (each command adds its own options between them, in this order): `add_source_options` (the base model, the
data, where the result and the checkpoints go), `add_schedule_options` (steps, rows per step, learning rate),
`add_precision_options` (training and saved dtype, the time budget) and `add_run_options` (threads, progress).
`train-medusa` and `train-eagle` take all four; `finetune` and `train-reference` the last. Helpers turn the options
into what they mean: the loaded base model, the output folder, the head trainers' keyword arguments, and the part
of a `training.json` record that the options and the machine decide.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..arguments import at_least
from ..bench.output import hardware

REFERENCE_TARGET = "hf_accel reference target"  # what records name the default base model
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_source_options(parser: argparse.ArgumentParser, written: str) -> None:
    """--model, --dataset, --out (`written`: what the command saves there), --checkpoint-dir, --checkpoint-every,
    --resume-from."""
    parser.add_argument("--model", default=None, help="local folder of a causal LM (default: the reference target)")
    parser.add_argument("--dataset", type=Path, default=None, help="datasets.save_to_disk folder (default: corpus)")
    parser.add_argument("--out", type=Path, default=None, help=f"where to save {written} (default: reference assets)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="resumable checkpoints go here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    parser.add_argument("--resume-from", type=Path, default=None, help="checkpoint folder to continue from")


def add_schedule_options(parser: argparse.ArgumentParser, steps: int) -> None:
    """--steps (default `steps`), --batch-size, --seq-len, --lr."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)


def add_precision_options(parser: argparse.ArgumentParser, budget_help: str) -> None:
    """--dtype (autocast while training), --save-dtype, --time-budget (`budget_help`: what it covers)."""
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="autocast dtype while training")
    parser.add_argument("--save-dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--time-budget", type=float, default=None, help=budget_help)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--threads (torch CPU threads, >= 1), --no-progress."""
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true")


def apply_threads(threads: int | None) -> None:
    """Set torch's CPU threads when `--threads` was given."""
    if threads is not None:
        torch.set_num_threads(threads)


def start_head_command(args: argparse.Namespace, reference_folder: Path, prog: str
                       ) -> tuple[Path, PreTrainedModel, PreTrainedTokenizerBase, str]:
    """What `train-medusa` and `train-eagle` do first: set `--threads`, resolve `--out` (by default
    `reference_folder`, the shipped assets, when the base model is the reference target; exits naming `prog` when a
    `--model` comes without `--out`) and load the base model. Returns `(out, model, tokenizer, description)`."""
    apply_threads(args.threads)
    out = args.out or (reference_folder if args.model is None else None)
    if out is None:
        raise SystemExit(f"{prog}: --out is required with --model")
    return (out, *load_base_model(args.model))


def load_base_model(model: str | None, dtype: torch.dtype | None = None
                    ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """`(model, tokenizer, description)` of the `--model` folder (offline, in eval mode; `dtype` None: the
    checkpoint's), or of the reference target when it is None."""
    if model is None:
        target, tokenizer = reference.load("target")
        return target, tokenizer, REFERENCE_TARGET
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, local_files_only=True).eval()
    return loaded, AutoTokenizer.from_pretrained(model, local_files_only=True), str(model)


def trainer_arguments(args: argparse.Namespace, spent_s: float = 0.0) -> dict[str, Any]:
    """The keyword arguments of `train_medusa` / `train_eagle` that the shared options set; the time budget less
    the `spent_s` seconds the command already used (the budget covers data preparation and training)."""
    return {
        "output_dir": args.checkpoint_dir, "resume_from": args.resume_from, "progress": not args.no_progress,
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
        "dtype": args.dtype, "checkpoint_every": args.checkpoint_every,
        "time_budget_s": None if args.time_budget is None else args.time_budget - spent_s,
    }


def command_record(args: argparse.Namespace, description: str, settings: Sequence[str]) -> dict[str, Any]:
    """The part of a `training.json` record that the options and the machine decide: the base model, the values of
    the options named in `settings`, the hardware."""
    return {"base_model": description, "settings": {key: getattr(args, key) for key in settings},
            "hardware": hardware()}


__all__ = ["DTYPES", "REFERENCE_TARGET", "add_precision_options", "add_run_options", "add_schedule_options",
           "add_source_options", "apply_threads", "command_record", "load_base_model", "start_head_command",
           "trainer_arguments"]
