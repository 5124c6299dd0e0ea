"""`hf-accel train-medusa`: train Medusa heads for a model, measure them on held-out text, save them.

    hf-accel train-medusa --steps 2000 --time-budget 570    # the committed reference heads (~10 min on one core)
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
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import reference
from ..reference.corpus import load_split, pack_sequences, tokenize
from ..speculative.medusa_heads import MedusaHeads
from .calibrate import calibrate_tree, head_accuracy
from .train import MedusaTrainResult, self_distilled_rows, token_rows, train_medusa

REFERENCE_HEADS_DIR = reference.ASSETS_DIR / "medusa"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options of `hf-accel train-medusa`."""
    parser = argparse.ArgumentParser(prog="hf-accel train-medusa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local folder of a causal LM (default: the reference target)")
    parser.add_argument("--dataset", type=Path, default=None, help="datasets.save_to_disk folder (default: corpus)")
    parser.add_argument("--out", type=Path, default=None, help="where to save the heads (default: reference assets)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="resumable checkpoints go here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    parser.add_argument("--resume-from", type=Path, default=None, help="checkpoint folder to continue from")
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--decay-factor", type=float, default=0.8)
    parser.add_argument("--distill", choices=("none", "hard", "soft"), default="hard")
    parser.add_argument("--self-distill-rows", type=int, default=256,
                        help="train on the model's own greedy continuations of this many 32-token prompts from "
                             "the data instead of the data itself (0: the data)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="autocast dtype while training")
    parser.add_argument("--save-dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    parser.add_argument("--eval-rows", type=int, default=16, help="held-out rows of seq-len tokens for accuracy")
    parser.add_argument("--tree-size", type=int, default=20, help="candidates in the calibrated tree")
    parser.add_argument("--calibration-prompts", type=int, default=16, help="prompts whose greedy output fits the tree")
    parser.add_argument("--calibrate-only", action="store_true", help="refit the tree of the heads in --out")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def _load(args: argparse.Namespace):
    if args.model is None:
        model, tokenizer = reference.load("target")
        return model, tokenizer, "hf_accel reference target"
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(args.model, local_files_only=True), str(args.model)


def _dataset(args: argparse.Namespace) -> Any:
    if args.dataset is None:
        return load_split("train").texts
    import datasets  # optional dependency, needed only for --dataset

    return datasets.load_from_disk(str(args.dataset))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel train-medusa`; returns the exit status."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = args.out or (REFERENCE_HEADS_DIR if args.model is None else None)
    if out is None:
        raise SystemExit("hf-accel train-medusa: --out is required with --model")
    model, tokenizer, description = _load(args)
    if args.calibrate_only:
        heads = MedusaHeads.from_pretrained(out)
        record = json.loads((Path(out) / "training.json").read_text())
    else:
        result, generation_s = _train(args, model, tokenizer)
        heads = result.heads.to(torch.bfloat16 if args.save_dtype == "bf16" else torch.float32)
        held_out = reference.held_out_sequences(tokenizer, seq_len=args.seq_len, max_rows=args.eval_rows)
        record = _record(args, description, result, head_accuracy(model, heads, held_out), held_out)
        record["self_distillation_data_seconds"] = round(generation_s, 1)
    heads.config.base_model_name_or_path = description
    record["calibration"] = _calibrate(args, model, heads, tokenizer)
    heads.save_pretrained(out)
    (Path(out) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["held_out_top1_accuracy"]), f"trained {record['train_seconds']:.0f} s; wrote {out}")
    return 0


def _train(args: argparse.Namespace, model, tokenizer) -> tuple[MedusaTrainResult, float]:
    """Train; returns the result and the seconds spent generating self-distillation data."""
    data, started = _dataset(args), time.perf_counter()
    if args.self_distill_rows:
        rows = token_rows(data, args.seq_len, tokenizer, model.generation_config.eos_token_id)
        order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))[: args.self_distill_rows]
        data = self_distilled_rows(model, rows[order], progress=not args.no_progress)
    generation_s = time.perf_counter() - started if args.self_distill_rows else 0.0
    return train_medusa(
        model, data, tokenizer=tokenizer, output_dir=args.checkpoint_dir, resume_from=args.resume_from,
        progress=not args.no_progress, num_heads=args.num_heads, num_layers=args.num_layers, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, decay_factor=args.decay_factor,
        distill=args.distill, dtype=args.dtype, checkpoint_every=args.checkpoint_every,
        time_budget_s=None if args.time_budget is None else args.time_budget - generation_s,  # budget covers both
    ), generation_s


def _calibrate(args: argparse.Namespace, model, heads: MedusaHeads, tokenizer) -> dict[str, Any]:
    """Store in `heads.config.tree` a sparse tree fitted to how the heads rank the model's own greedy output
    (continuations of the last rows of the corpus's whole held-out split, as for the shipped heads; the benchmarks'
    prompts are its first rows, the text shipped in the package)."""
    split = tokenize(load_split("held_out").texts, tokenizer)
    prompts = pack_sequences(split, tokenizer.eos_token_id, 64)[-args.calibration_prompts :]
    tree, rates = calibrate_tree(model, heads, prompts, new_tokens=128, num_candidates=args.tree_size)
    heads.config.tree = tree
    return {"prompts": int(prompts.shape[0]), "prompt_len": 64, "new_tokens": 128, "tree_size": len(tree),
            "rank_accuracy_on_own_greedy_output": [[round(r, 4) for r in row] for row in rates.tolist()]}


def _record(args, description: str, result, accuracy: list[float], held_out: torch.Tensor) -> dict[str, Any]:
    return {
        "base_model": description,
        "train_seconds": round(result.train_seconds, 1),
        "steps": result.last_step,
        "tokens_seen": result.last_step * args.batch_size * args.seq_len,
        "final_loss": round(sum(result.losses[-20:]) / max(len(result.losses[-20:]), 1), 4) if result.losses else None,
        "held_out_top1_accuracy": {f"head_{k}": round(a, 4) for k, a in enumerate(accuracy)},
        "held_out_tokens": int(held_out.numel()),
        "accuracy_rule": "head k's argmax at position t equals the held-out text's token t+2+k",
        "settings": {key: getattr(args, key) for key in (
            "num_heads", "num_layers", "batch_size", "seq_len", "lr", "decay_factor", "distill", "self_distill_rows",
            "dtype", "save_dtype", "threads")},
        "hardware": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                     "torch": torch.__version__},
    }


if __name__ == "__main__":
    raise SystemExit(main())
