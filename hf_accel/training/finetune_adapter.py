"""The fine-tune path stopped at the adapter (`hf-accel finetune --adapter-only`): LoRA -> check -> a peft adapter
folder, served unmerged beside other adapters over one base.

    report = run_adapter_finetune(model, tokenizer, domain_splits(), "adapters/docs", FinetuneConfig())
    # hf-accel serve --model BASE --lora-modules docs=adapters/docs

The folder `out` holds what peft's `save_pretrained` writes (`adapter_config.json`, `adapter_model.safetensors`),
which `hf-accel serve --lora-modules`, `hf_accel.LoRARequest` and vLLM's `--lora-modules` load as they are, plus
`README.md` (how to serve it) and `report.json` (held-out perplexity of the base and of the base with the adapter,
the training losses, each stage's time). No merge, no Medusa heads, no quantization: the base stays shared.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..lora.config import LoRAConfig
from .finetune import REPORT_NAME, FinetuneConfig, StageClock, base_report, evaluate, train_adapter
from .finetune_domain import DomainSplits

README_NAME = "README.md"


def adapter_serve_command(out: str | Path, base_model: str | Path | None, rank: int) -> str:
    """The `hf-accel serve` line serving the adapter folder `out` (named for the folder) over `base_model` (a local
    folder; None: the reference target, `serve`'s default); `--max-lora-rank` when `rank` is over serve's default."""
    out = Path(out)
    args = ["hf-accel", "serve"] + ([] if base_model is None else ["--model", str(base_model)])
    args += ["--lora-modules", f"{out.resolve().name}={out}"]
    if rank > LoRAConfig.max_lora_rank:
        args += ["--max-lora-rank", str(rank)]
    return shlex.join(args)


def run_adapter_finetune(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, splits: DomainSplits,
                         out: str | Path, config: FinetuneConfig | None = None,
                         original_rows: torch.Tensor | None = None, description: str = "",
                         base_model: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Train a LoRA adapter on `model` (wrapped in place by peft) and write it to `out` as a peft adapter folder.

    Of `config` only `seq_len`, `eval_rows` and `lora` apply. `original_rows`: `[n, seq]` ids of the base's own
    domain (optional). `base_model`: the base's folder as `hf-accel serve --model` takes it, for the serve line
    (None: the reference target). Returns the report also written to `out/report.json`."""
    config, out, clock = config or FinetuneConfig(), Path(out), StageClock()
    run = train_adapter(model, tokenizer, splits, config, original_rows, clock, progress)
    adapted = run.trained.model
    run.perplexities["finetuned"] = evaluate(adapted, run.eval_sets, clock, "evaluate fine-tuned")
    with clock.stage("save adapter"):
        adapted.save_pretrained(out)
    command = adapter_serve_command(out, base_model, config.lora.rank)
    settings = {"adapter_only": True, "seq_len": config.seq_len, "eval_rows": config.eval_rows,
                "lora": asdict(config.lora)}
    report = base_report(description, splits, run, settings, clock) | {"serve": command}
    (out / README_NAME).write_text(_readme(description, config, report, command))
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _readme(description: str, config: FinetuneConfig, report: dict[str, Any], command: str) -> str:
    lora, perplexity = config.lora, report["perplexity"]
    return (
        f"# LoRA adapter for {description or 'a causal LM'}\n\n"
        f"Written by `hf-accel finetune --adapter-only`: a peft LoRA adapter (rank {lora.rank}, alpha {lora.alpha}, "
        f"on {', '.join(lora.target_modules)}; {lora.steps} steps of {lora.batch_size} rows), not merged.\n"
        f"Held-out domain perplexity: {perplexity['base']['domain']} (base) -> {perplexity['finetuned']['domain']} "
        "(with the adapter); `report.json` has the rest.\n\n"
        "## Serve\n\n"
        f"```bash\n{command}\n```\n\n"
        "The request's `model` (the name before `=`) selects the adapter; add more `NAME=PATH` entries to serve "
        "several adapters over the same base. vLLM loads the folder too (`vllm serve BASE --enable-lora "
        "--lora-modules NAME=PATH`; `hf-accel export --format vllm --lora-modules NAME=PATH` writes that line).\n"
    )


__all__ = ["README_NAME", "adapter_serve_command", "run_adapter_finetune"]
