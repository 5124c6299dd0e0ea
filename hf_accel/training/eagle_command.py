"""`hf-accel train-eagle`: train an EAGLE head for a model, measure its acceptance on held-out text, save it.

    hf-accel train-eagle --time-budget 900 --threads 1      # the committed reference head
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..speculative.eagle import eagle_generate
from ..speculative.eagle_head import EagleHead
from ..speculative.stats import SpeculativeStats
from .data import self_distilled_data, training_data
from .eagle_trainer import EagleTrainResult, train_eagle
from .options import (
    DTYPES, add_precision_options, add_run_options, add_schedule_options, add_source_options, command_record,
    start_head_command, trainer_arguments,
)
from .train_loop import final_loss

REFERENCE_HEAD_DIR = reference.ASSETS_DIR / "eagle"
RECORDED_SETTINGS = ("batch_size", "seq_len", "lr", "unroll_steps", "step_decay", "self_distill_rows", "corpus_rows",
                     "dtype", "save_dtype", "threads")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Options of `hf-accel train-eagle`."""
    parser = argparse.ArgumentParser(prog="hf-accel train-eagle", description=__doc__.split("\n\n")[0])
    add_source_options(parser, "the head")
    add_schedule_options(parser, steps=450)
    parser.add_argument("--unroll-steps", type=int, default=5, help="draft steps trained per position")
    parser.add_argument("--step-decay", type=float, default=0.8, help="loss weight of draft step j: decay ** j")
    parser.add_argument("--self-distill-rows", type=int, default=384,
                        help="train on the model's own greedy continuations of this many prompts (0: the data)")
    parser.add_argument("--corpus-rows", type=int, default=768,
                        help="with --self-distill-rows, also train on this many rows of the data itself (labels are "
                             "the model's greedy tokens either way)")
    add_precision_options(parser, "stop after this many seconds in all")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the acceptance figures")
    add_run_options(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel train-eagle`; returns the exit status."""
    args = parse_args(argv)
    out, model, tokenizer, description = start_head_command(args, REFERENCE_HEAD_DIR, "hf-accel train-eagle")
    started = time.perf_counter()
    data = _data(args, model, tokenizer)
    generation_s = time.perf_counter() - started
    result = train_eagle(model, data, tokenizer=tokenizer, **trainer_arguments(args, generation_s),
                         unroll_steps=args.unroll_steps, step_decay=args.step_decay)
    head = result.head.to(DTYPES[args.save_dtype])
    head.config.base_model_name_or_path = description
    head.save_pretrained(out)
    stats = held_out_acceptance(model, head, tokenizer, args.eval_prompts)
    record = _record(args, description, result, generation_s, stats)
    (Path(out) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"tokens per target forward {stats.tokens_per_forward:.2f}; trained {result.train_seconds:.0f} s; "
          f"wrote {out}")
    return 0


def _data(args: argparse.Namespace, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Any:
    data = training_data(args.dataset)
    if not args.self_distill_rows:
        return data
    return self_distilled_data(model, data, tokenizer, args.seq_len, args.self_distill_rows, args.corpus_rows,
                               progress=not args.no_progress)


def held_out_acceptance(model: PreTrainedModel, head: EagleHead, tokenizer: PreTrainedTokenizerBase,
                        num_prompts: int = 8, prompt_len: int = 64, new_tokens: int = 128) -> SpeculativeStats:
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
        **command_record(args, description, RECORDED_SETTINGS),
        "self_distillation_data_seconds": round(generation_s, 1),
        "target_feature_seconds": round(result.feature_seconds, 1),
        "train_seconds": round(result.train_seconds, 1),
        "steps": result.last_step,
        "tokens_seen": (result.last_step - result.first_step) * args.batch_size * args.seq_len,
        "final_loss": final_loss(result.losses),
        "train_top1_by_draft_step": [round(sum(a[j] for a in last) / len(last), 4) for j in range(len(last[0]))]
        if last else None,
        "held_out": {"prompts": args.eval_prompts, "prompt_len": 64, "new_tokens": 128, "mode": "greedy, batch 1",
                     "tokens_per_target_forward": round(stats.tokens_per_forward, 3),
                     "acceptance_by_position": [round(a, 3) for a in stats.acceptance_by_position]},
    }


if __name__ == "__main__":
    raise SystemExit(main())
