"""`hf-accel train-medusa`: train Medusa heads for a model, measure them on held-out text, save them.

    hf-accel train-medusa --steps 2000 --time-budget 570    # the committed reference heads
    hf-accel train-medusa --model ./my-model --dataset ./my-dataset --out ./my-model-medusa --steps 2000

Default data: the reference corpus's train split, else `--dataset`, a folder written by
`datasets.Dataset.save_to_disk` with a "text" or "input_ids" column; by default the heads train on the model's own
greedy continuations of 256 prompts cut from it (`--self-distill-rows`, 0 for the data itself). Held-out accuracy
reads the first rows of the held-out text shipped in the package (`reference.held_out_sequences`), the tree
calibration the last rows of the reference corpus's whole held-out split (both tokenized with the model's
tokenizer; the corpus needs the `dev` extra, as the default data does). Writes
`<out>/medusa_config.json`, `<out>/medusa_heads.safetensors` and `<out>/training.json` (time, steps, per-head
held-out top-1 accuracy). The heads' config also gets a candidate tree calibrated on the model's own greedy output
(`--tree-size` candidates).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..reference.corpus import load_split, pack_sequences, tokenize
from ..speculative.medusa_heads import MedusaHeads
from .data import self_distilled_data, training_data
from .medusa_calibration import calibrate_tree, head_accuracy
from .medusa_trainer import MedusaTrainResult, train_medusa
from .options import (
    DTYPES, add_precision_options, add_run_options, add_schedule_options, add_source_options, command_record,
    start_head_command, trainer_arguments,
)
from .train_loop import final_loss

REFERENCE_HEADS_DIR = reference.ASSETS_DIR / "medusa"
RECORDED_SETTINGS = ("num_heads", "num_layers", "batch_size", "seq_len", "lr", "decay_factor", "distill",
                     "self_distill_rows", "dtype", "save_dtype", "threads")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options of `hf-accel train-medusa`."""
    parser = argparse.ArgumentParser(prog="hf-accel train-medusa", description=__doc__.split("\n\n")[0])
    add_source_options(parser, "the heads")
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=1)
    add_schedule_options(parser, steps=400)
    parser.add_argument("--decay-factor", type=float, default=0.8)
    parser.add_argument("--distill", choices=("none", "hard", "soft"), default="hard")
    parser.add_argument("--self-distill-rows", type=int, default=256,
                        help="train on the model's own greedy continuations of this many 32-token prompts from "
                             "the data instead of the data itself (0: the data)")
    add_precision_options(parser, "stop training after this many seconds")
    parser.add_argument("--eval-rows", type=int, default=16, help="held-out rows of seq-len tokens for accuracy")
    parser.add_argument("--tree-size", type=int, default=20, help="candidates in the calibrated tree")
    parser.add_argument("--calibration-prompts", type=int, default=16, help="prompts whose greedy output fits the tree")
    parser.add_argument("--calibrate-only", action="store_true", help="refit the tree of the heads in --out")
    add_run_options(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel train-medusa`; returns the exit status."""
    args = parse_args(argv)
    out, model, tokenizer, description = start_head_command(args, REFERENCE_HEADS_DIR, "hf-accel train-medusa")
    if args.calibrate_only:
        heads = MedusaHeads.from_pretrained(out)
        record = json.loads((Path(out) / "training.json").read_text())
    else:
        heads, record = _train(args, model, tokenizer, description)
    heads.config.base_model_name_or_path = description
    record["calibration"] = _calibrate(args, model, heads, tokenizer)
    heads.save_pretrained(out)
    (Path(out) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["held_out_top1_accuracy"]), f"trained {record['train_seconds']:.0f} s; wrote {out}")
    return 0


def _train(args: argparse.Namespace, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
           description: str) -> tuple[MedusaHeads, dict[str, Any]]:
    """Heads trained as the options say (in the save dtype) and their record; the time budget covers generating
    the self-distillation data and training."""
    data, started = training_data(args.dataset), time.perf_counter()
    if args.self_distill_rows:
        data = self_distilled_data(model, data, tokenizer, args.seq_len, args.self_distill_rows,
                                   progress=not args.no_progress)
    generation_s = time.perf_counter() - started if args.self_distill_rows else 0.0
    result = train_medusa(model, data, tokenizer=tokenizer, **trainer_arguments(args, generation_s),
                          num_heads=args.num_heads, num_layers=args.num_layers, decay_factor=args.decay_factor,
                          distill=args.distill)
    heads = result.heads.to(DTYPES[args.save_dtype])
    held_out = reference.held_out_sequences(tokenizer, seq_len=args.seq_len, max_rows=args.eval_rows)
    record = _record(args, description, result, head_accuracy(model, heads, held_out), held_out)
    record["self_distillation_data_seconds"] = round(generation_s, 1)
    return heads, record


def _calibrate(args: argparse.Namespace, model: PreTrainedModel, heads: MedusaHeads,
               tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Store in `heads.config.tree` a sparse tree fitted to how the heads rank the model's own greedy output
    (continuations of the last rows of the corpus's whole held-out split, as for the shipped heads; the benchmarks'
    prompts are its first rows, the text shipped in the package)."""
    split = tokenize(load_split("held_out").texts, tokenizer)
    prompts = pack_sequences(split, tokenizer.eos_token_id, 64)[-args.calibration_prompts :]
    tree, rates = calibrate_tree(model, heads, prompts, new_tokens=128, num_candidates=args.tree_size)
    heads.config.tree = tree
    return {"prompts": int(prompts.shape[0]), "prompt_len": 64, "new_tokens": 128, "tree_size": len(tree),
            "rank_accuracy_on_own_greedy_output": [[round(r, 4) for r in row] for row in rates.tolist()]}


def _record(args: argparse.Namespace, description: str, result: MedusaTrainResult, accuracy: list[float],
            held_out: torch.Tensor) -> dict[str, Any]:
    return {
        **command_record(args, description, RECORDED_SETTINGS),
        "train_seconds": round(result.train_seconds, 1),
        "steps": result.last_step,
        "tokens_seen": result.last_step * args.batch_size * args.seq_len,
        "final_loss": final_loss(result.losses),
        "held_out_top1_accuracy": {f"head_{k}": round(a, 4) for k, a in enumerate(accuracy)},
        "held_out_tokens": int(held_out.numel()),
        "accuracy_rule": "head k's argmax at position t equals the held-out text's token t+2+k",
    }


if __name__ == "__main__":
    raise SystemExit(main())
