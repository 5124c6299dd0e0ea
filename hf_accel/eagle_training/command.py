"""`hf-accel train-eagle`: train an EAGLE head for a model, measure its acceptance on held-out text, save it.

    hf-accel train-eagle --time-budget 900 --threads 1      # the committed reference head (~15 min on one core)
    hf-accel train-eagle --model ./my-model --dataset ./my-dataset --out ./my-model-eagle --steps 2000

Default data: the reference corpus's train split (needs the `dev` extra), else `--dataset`, a folder written by
`datasets.Dataset.save_to_disk` with a "text" or "input_ids" column; the head trains on the model's own greedy
continuations of `--self-distill-rows` 32-token prompts cut from it, plus `--corpus-rows` rows of the data itself
(the labels are the model's greedy tokens either way; 0 self-distilled rows: the data alone). The time budget covers
generating that data, the target's features and training. Acceptance: `eagle_generate` continuing the first
`--eval-prompts` rows of the held-out text shipped in the package (64-token prompts, greedy, batch 1), as tokens per
target forward and acceptance per draft position. Writes `<out>/eagle_config.json`, `<out>/eagle_head.safetensors`
and `<out>/training.json`.
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
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .. import reference
from ..medusa_training.train import self_distilled_rows, token_rows
from ..reference.corpus import load_split
from ..speculative.eagle import eagle_generate
from ..speculative.eagle_head import EagleHead
from ..speculative.stats import SpeculativeStats
from .train import EagleTrainResult, train_eagle

REFERENCE_HEAD_DIR = reference.ASSETS_DIR / "eagle"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options of `hf-accel train-eagle`."""
    parser = argparse.ArgumentParser(prog="hf-accel train-eagle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local folder of a causal LM (default: the reference target)")
    parser.add_argument("--dataset", type=Path, default=None, help="datasets.save_to_disk folder (default: corpus)")
    parser.add_argument("--out", type=Path, default=None, help="where to save the head (default: reference assets)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="resumable checkpoints go here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    parser.add_argument("--resume-from", type=Path, default=None, help="checkpoint folder to continue from")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--unroll-steps", type=int, default=5, help="draft steps trained per position")
    parser.add_argument("--step-decay", type=float, default=0.8, help="loss weight of draft step j: decay ** j")
    parser.add_argument("--self-distill-rows", type=int, default=384,
                        help="train on the model's own greedy continuations of this many prompts (0: the data)")
    parser.add_argument("--corpus-rows", type=int, default=768,
                        help="with --self-distill-rows, also train on this many rows of the data itself (labels are "
                             "the model's greedy tokens either way)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="autocast dtype while training")
    parser.add_argument("--save-dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds in all")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the acceptance figures")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel train-eagle`; returns the exit status."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = args.out or (REFERENCE_HEAD_DIR if args.model is None else None)
    if out is None:
        raise SystemExit("hf-accel train-eagle: --out is required with --model")
    model, tokenizer, description = _load(args)
    started = time.perf_counter()
    data = _data(args, model, tokenizer)
    generation_s = time.perf_counter() - started
    budget = None if args.time_budget is None else args.time_budget - generation_s
    result = train_eagle(
        model, data, tokenizer=tokenizer, output_dir=args.checkpoint_dir, resume_from=args.resume_from,
        progress=not args.no_progress, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        lr=args.lr, unroll_steps=args.unroll_steps, step_decay=args.step_decay, dtype=args.dtype,
        checkpoint_every=args.checkpoint_every, time_budget_s=budget,
    )
    head = result.head.to(torch.bfloat16 if args.save_dtype == "bf16" else torch.float32)
    head.config.base_model_name_or_path = description
    head.save_pretrained(out)
    stats = held_out_acceptance(model, head, tokenizer, args.eval_prompts)
    record = _record(args, description, result, generation_s, stats)
    (Path(out) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"tokens per target forward {stats.tokens_per_forward:.2f}; trained {result.train_seconds:.0f} s; "
          f"wrote {out}")
    return 0


def _load(args: argparse.Namespace):
    if args.model is None:
        model, tokenizer = reference.load("target")
        return model, tokenizer, "hf_accel reference target"
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(args.model, local_files_only=True), str(args.model)


def _data(args: argparse.Namespace, model: PreTrainedModel, tokenizer) -> Any:
    if args.dataset is None:
        data = load_split("train").texts
    else:
        import datasets  # optional dependency, needed only for --dataset

        data = datasets.load_from_disk(str(args.dataset))
    if not args.self_distill_rows:
        return data
    rows = token_rows(data, args.seq_len, tokenizer, model.generation_config.eos_token_id)
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))
    distilled = self_distilled_rows(model, rows[order[: args.self_distill_rows]], progress=not args.no_progress)
    extra = order[args.self_distill_rows : args.self_distill_rows + args.corpus_rows]
    return torch.cat([distilled, rows[extra]])


def held_out_acceptance(model: PreTrainedModel, head: EagleHead, tokenizer, num_prompts: int = 8,
                        prompt_len: int = 64, new_tokens: int = 128) -> SpeculativeStats:
    """`eagle_generate`'s counters continuing the first `num_prompts` held-out rows (greedy, batch 1)."""
    prompts = reference.held_out_sequences(tokenizer, seq_len=prompt_len, max_rows=num_prompts)
    stats = SpeculativeStats()
    for prompt in prompts:
        model.generate(prompt[None].to(model.device), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                       pad_token_id=0, custom_generate=eagle_generate, eagle_head=head, eagle_stats=stats)
    return stats


def _record(args: argparse.Namespace, description: str, result: EagleTrainResult, generation_s: float,
            stats: SpeculativeStats) -> dict[str, Any]:
    last = result.accuracies[-20:]
    return {
        "base_model": description,
        "self_distillation_data_seconds": round(generation_s, 1),
        "target_feature_seconds": round(result.feature_seconds, 1),
        "train_seconds": round(result.train_seconds, 1),
        "steps": result.last_step,
        "tokens_seen": (result.last_step - result.first_step) * args.batch_size * args.seq_len,
        "final_loss": round(sum(result.losses[-20:]) / max(len(result.losses[-20:]), 1), 4) if result.losses else None,
        "train_top1_by_draft_step": [round(sum(a[j] for a in last) / len(last), 4) for j in range(len(last[0]))]
        if last else None,
        "held_out": {"prompts": args.eval_prompts, "prompt_len": 64, "new_tokens": 128, "mode": "greedy, batch 1",
                     "tokens_per_target_forward": round(stats.tokens_per_forward, 3),
                     "acceptance_by_position": [round(a, 3) for a in stats.acceptance_by_position]},
        "settings": {key: getattr(args, key) for key in (
            "batch_size", "seq_len", "lr", "unroll_steps", "step_decay", "self_distill_rows", "corpus_rows", "dtype",
            "save_dtype",
            "threads")},
        "hardware": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                     "torch": torch.__version__},
    }


if __name__ == "__main__":
    raise SystemExit(main())
