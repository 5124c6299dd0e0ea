"""`hf-accel finetune`: LoRA fine-tune a causal LM on local domain text, merge, train Medusa heads, quantize,
check, and write a folder that `hf-accel serve --model OUT` serves with its heads and quantization; or, with
`--adapter-only`, stop at the adapter and write a peft adapter folder served unmerged beside others.

    hf-accel finetune --out ./docs-model                   # the reference target on package descriptions
    hf-accel serve --model ./docs-model                    # int8 weights + Medusa heads, from OUT/hf_accel.json
    hf-accel finetune --adapter-only --out ./docs          # adapter_config.json + adapter_model.safetensors
    hf-accel serve --lora-modules docs=./docs              # the request's `model: docs` selects it

Data: the long descriptions (READMEs) of the installed distributions, split by distribution
(`hf_accel.training.finetune_domain`). With the reference target, the heads start from its shipped Medusa heads.
Writes OUT/ (merged model in float32 + tokenizer), OUT/medusa/, OUT/hf_accel.json and OUT/report.json; with
--adapter-only, OUT/ holds the adapter, README.md (the serve line) and report.json.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import reference
from ..arguments import at_least
from ..quant.presets import PRESETS
from ..speculative.medusa_heads import MedusaHeads
from .finetune import FinetuneConfig, run_finetune
from .finetune_adapter import run_adapter_finetune
from .finetune_domain import domain_splits
from .finetune_report import report_tables
from .lora import LoraSettings
from .options import add_run_options, apply_threads, load_base_model

QUANT_CHOICES = ("none", *(preset.name for preset in PRESETS))
# options of the merged path's later stages (heads, quantization, speed check): an error with --adapter-only
NOT_WITH_ADAPTER_ONLY = ("quant", "init_heads", "medusa_steps", "self_distill_rows", "speed_prompts", "new_tokens",
                         "repeats")


def build_parser() -> argparse.ArgumentParser:
    """Options of `hf-accel finetune` (docs/bench_finetune.md: what the defaults cost and give)."""
    parser = argparse.ArgumentParser(prog="hf-accel finetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder to write (must not hold a model yet)")
    parser.add_argument("--model", default=None, metavar="PATH", help="local causal LM folder (default: the reference "
                        "target)")
    parser.add_argument("--adapter-only", action="store_true", help="stop at the LoRA adapter: OUT is a peft adapter "
                        "folder for `hf-accel serve --lora-modules` (no merge, heads, quantization or speed check)")
    parser.add_argument("--quant", default="int8", choices=QUANT_CHOICES, help="weight preset (default: %(default)s)")
    parser.add_argument("--init-heads", default=None, metavar="PATH", help="Medusa heads to start from; 'none' for "
                        "new ones (default: the reference heads with the reference target, else new)")
    parser.add_argument("--seq-len", type=at_least(48), default=128, help="tokens per row (default: %(default)s)")
    parser.add_argument("--lora-steps", type=at_least(1), default=120, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=at_least(1), default=8, help="LoRA rows per step (default: %(default)s)")
    parser.add_argument("--lora-rank", type=at_least(1), default=16, help="(default: %(default)s)")
    parser.add_argument("--lora-alpha", type=at_least(1), default=32, help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="LoRA learning rate (default: %(default)s)")
    parser.add_argument("--medusa-steps", type=at_least(1), default=120, help="(default: %(default)s)")
    parser.add_argument("--self-distill-rows", type=at_least(1), default=64, help="(default: %(default)s)")
    parser.add_argument("--eval-rows", type=at_least(1), default=48, help="held-out rows (default: %(default)s)")
    parser.add_argument("--speed-prompts", type=at_least(1), default=4, help="(default: %(default)s)")
    parser.add_argument("--new-tokens", type=at_least(1), default=64, help="(default: %(default)s)")
    parser.add_argument("--repeats", type=at_least(1), default=2, help="(default: %(default)s)")
    parser.add_argument("--held-out-percent", type=float, default=15.0, help="(default: %(default)s)")
    add_run_options(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    """The stage sizes the options ask for."""
    lora = LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, steps=args.lora_steps,
                        batch_size=args.batch_size, lr=args.lr)
    return FinetuneConfig(seq_len=args.seq_len, lora=lora, medusa_steps=args.medusa_steps,
                          self_distill_rows=args.self_distill_rows, quant=None if args.quant == "none" else args.quant,
                          eval_rows=args.eval_rows, speed_prompts=args.speed_prompts, new_tokens=args.new_tokens,
                          repeats=args.repeats)


def init_heads(args: argparse.Namespace) -> MedusaHeads | None:
    """The heads training starts from (see `--init-heads`)."""
    if args.init_heads == "none" or (args.init_heads is None and args.model is not None):
        return None
    if args.init_heads is None:
        return reference.load_head("medusa", dtype=torch.float32)
    return MedusaHeads.from_pretrained(args.init_heads, dtype=torch.float32)


def options_not_with_adapter_only(argv: Sequence[str] | None) -> list[str]:
    """The options of `NOT_WITH_ADAPTER_ONLY` that `argv` gives explicitly (`--quant none` is allowed), as flags."""
    probe = build_parser()
    probe.set_defaults(**{name: None for name in NOT_WITH_ADAPTER_ONLY})
    given = vars(probe.parse_args(argv))
    return ["--" + name.replace("_", "-") for name in NOT_WITH_ADAPTER_ONLY
            if given[name] is not None and not (name == "quant" and given[name] == "none")]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-accel finetune`; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.adapter_only and (refused := options_not_with_adapter_only(argv)):
        parser.error(f"{', '.join(refused)} cannot be used with --adapter-only (it writes the LoRA adapter alone: "
                     "no merge, Medusa heads, quantization or speed check)")
    held = [name for name in ("config.json", "adapter_config.json") if (args.out / name).exists()]
    if held:
        parser.error(f"--out {args.out} already holds a model ({held[0]}); choose a new folder")
    if not 0 < args.held_out_percent < 100:
        parser.error(f"--held-out-percent must be in (0, 100), got {args.held_out_percent}")
    config = config_from_args(args)
    apply_threads(args.threads)
    model, tokenizer, description = load_base_model(args.model, dtype=torch.float32)
    original = reference.held_out_sequences(tokenizer, config.seq_len, config.eval_rows) if args.model is None else None
    splits, progress = domain_splits(args.held_out_percent), not args.no_progress
    if args.adapter_only:
        report = run_adapter_finetune(model, tokenizer, splits, args.out, config, original, description, args.model,
                                      progress)
    else:
        report = run_finetune(model, tokenizer, splits, args.out, config, init_heads(args), original, description,
                              progress)
    for table in report_tables(report):
        print(f"\n{table}")
    command = report["serve"] if args.adapter_only else f"hf-accel serve --model {args.out}"
    print(f"\nwrote {args.out}; serve it with: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
