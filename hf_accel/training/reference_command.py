"""Train the reference models from scratch: the ``hf-accel train-reference`` command.

``main(argv)`` gathers the corpus, trains (or reuses) the tokenizer, trains the target and/or the draft on packed
sequences with a fixed seed, saves each as bf16 safetensors with the tokenizer into ``<out>/<name>/``, reloads what
was saved and measures held-out perplexity, then writes ``<out>/report.json`` (the numbers for the model card)::

    hf-accel train-reference --which both            # default recipe, into hf_accel/reference/assets
    hf-accel train-reference --which draft --steps 50 --out ./ref
    hf-accel train-reference --which target --out ./ref --checkpoint-dir ./ref-ckpt --resume
    hf-accel train-reference --which none --out ./ref --baseline ./old-assets   # measure only

(or `python -m hf_accel.training.reference_command ...`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .options import add_run_options, apply_threads
from .reference_build import TrainStart, build_reference
from .reference_presets import TRAIN_RECIPES, TrainRecipe
from .reference_trainer import Checkpointing


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options of ``hf-accel train-reference``."""
    parser = argparse.ArgumentParser(prog="hf-accel train-reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--which", choices=("target", "draft", "both", "none"), default="both",
                        help="models to train ('none': only re-measure the models in --out)")
    parser.add_argument("--out", type=Path, default=None, help="assets folder (default: the package's)")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    parser.add_argument("--time-budget", type=float, default=None, help="stop each model after this many seconds")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="save resumable state to <dir>/<model>/checkpoint.pt (default: no checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="assets folder of an earlier target to measure on the same held-out rows")
    parser.add_argument("--grow-from", type=Path, default=None,
                        help="assets folder whose trained model is grown to the preset's depth and trained on")
    parser.add_argument("--skip-batches", type=int, default=0,
                        help="batches of the seeded order to skip (with --grow-from: the steps that model trained)")
    parser.add_argument("--distill-from", type=Path, default=None,
                        help="assets folder whose target the trained model imitates (KL to its next-token "
                             "distribution; for a draft that agrees with its target)")
    parser.add_argument("--lr", type=float, default=None, help="override the recipe's peak learning rate")
    parser.add_argument("--retrain-tokenizer", action="store_true", help="ignore <out>/tokenizer if present")
    add_run_options(parser)
    return parser.parse_args(argv)


def recipe_for(name: str, steps: int | None, lr: float | None = None) -> TrainRecipe:
    """The preset recipe of ``name``, with its step count (and warmup, proportionally) and peak learning rate
    overridden if asked."""
    recipe = TRAIN_RECIPES[name] if lr is None else replace(TRAIN_RECIPES[name], lr=lr)
    if steps is None:
        return recipe
    warmup = min(steps, max(1, round(recipe.warmup_steps * steps / recipe.steps)))
    return replace(recipe, steps=steps, warmup_steps=warmup)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-accel train-reference``; returns the exit status."""
    args = parse_args(argv)
    apply_threads(args.threads)
    names = {"both": ("target", "draft"), "none": ()}.get(args.which, (args.which,))
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir")
    checkpointing = None if args.checkpoint_dir is None else {
        name: Checkpointing(args.checkpoint_dir / name, args.checkpoint_every, args.resume) for name in names}
    report_path = build_reference(
        names=names,
        out=args.out,
        recipes={name: recipe_for(name, args.steps, args.lr) for name in names},
        time_budget_s=args.time_budget,
        retrain_tokenizer=args.retrain_tokenizer,
        progress=not args.no_progress,
        checkpointing=checkpointing,
        baseline=args.baseline,
        start=TrainStart(args.grow_from, args.skip_batches, args.distill_from),
    )
    print(f"wrote {report_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
