"""The fine-tune path, stage by stage: LoRA -> merge -> Medusa heads -> quantize -> check -> a folder to serve.

    report = run_finetune(model, tokenizer, domain_splits(), "out/", FinetuneConfig(quant="int8"))

The folder `out` is a normal transformers model folder (the merged model in float32 and its tokenizer) plus
`medusa/` (heads trained by self-distillation on the merged model), `hf_accel.json` (how `hf-accel serve --model
out` serves it) and `report.json` (each stage's held-out perplexity, greedy agreement and speed, and its time).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..bench.output import hardware
from ..quant.presets import PRESETS, load_model
from ..reference.evaluate import greedy_agreement
from ..serving_config import ServingConfig, write_serving_config
from ..speculative.medusa_heads import MedusaHeads
from .data import self_distilled_rows
from .finetune_domain import DomainSplits, text_rows
from .finetune_quality import Side, compare_speed, held_out_perplexity
from .lora import LoraResult, LoraSettings, merge_adapter, train_lora
from .medusa_trainer import train_medusa
from .train_loop import final_loss

HEADS_DIR = "medusa"
REPORT_NAME = "report.json"


@dataclass(slots=True)
class FinetuneConfig:
    """Sizes of every stage (the defaults are the `hf-accel finetune` defaults).

    Args:
        seq_len: tokens per training / evaluation row.
        lora: adapter and schedule (`LoraSettings`); its steps x batch_size rows are taken from the train split.
        medusa_steps, medusa_batch_size, medusa_lr: head training on `self_distill_rows` greedy continuations the
            merged model writes for 32-token prompts from the train split.
        quant: weight preset applied to the merged model ("int8", "int4", ... or None).
        eval_rows: held-out rows for perplexity.
        speed_prompts, prompt_len, new_tokens, repeats: the speed check (held-out prompts, batch 1).
    """

    seq_len: int = 128
    lora: LoraSettings = field(default_factory=LoraSettings)
    medusa_steps: int = 120
    medusa_batch_size: int = 8
    medusa_lr: float = 1e-3
    self_distill_rows: int = 64
    quant: str | None = "int8"
    eval_rows: int = 48
    speed_prompts: int = 4
    prompt_len: int = 32
    new_tokens: int = 64
    repeats: int = 2

    def __post_init__(self) -> None:
        for name in ("medusa_steps", "medusa_batch_size", "self_distill_rows", "eval_rows", "speed_prompts",
                     "prompt_len", "new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.seq_len < max(self.prompt_len + 8, 16):
            raise ValueError(f"`seq_len` must be at least max(prompt_len + 8, 16), got {self.seq_len}")
        names = [preset.name for preset in PRESETS]
        if self.quant is not None and self.quant not in names:
            raise ValueError(f"`quant` must be None or one of {names}, got {self.quant!r}")


@dataclass(slots=True)
class StageClock:
    """Seconds each stage took, in the order they ran."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - started, 1)


def run_finetune(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, splits: DomainSplits,
                 out: str | Path, config: FinetuneConfig | None = None, init_heads: MedusaHeads | None = None,
                 original_rows: torch.Tensor | None = None, description: str = "", progress: bool = True) -> dict:
    """Run every stage on `model` (changed in place: it becomes the merged model) and write the folder `out`.

    `init_heads`: Medusa heads to start from (default: new heads from the model's lm_head). `original_rows`:
    `[n, seq]` ids of the base model's own domain, to show what fine-tuning costs there (optional).
    Returns the report also written to `out/report.json`."""
    config, out, clock = config or FinetuneConfig(), Path(out), StageClock()
    run = train_adapter(model, tokenizer, splits, config, original_rows, clock, progress)
    train_rows, held_out, eval_sets, perplexities = run.train_rows, run.held_out, run.eval_sets, run.perplexities
    with clock.stage("merge and save"):
        merged = merge_adapter(run.trained.model)
        merged.save_pretrained(out)
        tokenizer.save_pretrained(out)
    perplexities["finetuned"] = evaluate(merged, eval_sets, clock, "evaluate fine-tuned")
    with clock.stage("medusa"):
        heads, medusa = _train_heads(merged, train_rows, config, init_heads, description, progress)
        heads.save_pretrained(out / HEADS_DIR)
    served, agreement = merged, 1.0
    if config.quant is not None:
        with clock.stage("quantize"):
            served = load_model(str(out), quant=config.quant, dtype=torch.float32).eval()
        perplexities["quantized"] = evaluate(served, eval_sets, clock, "evaluate quantized")
        agreement = _agreement(served, merged, held_out, clock)
    with clock.stage("speed"):
        speed = _speed(merged, served, heads, held_out, config)
    write_serving_config(out, ServingConfig(config.quant, HEADS_DIR))
    settings = {**asdict(config), "lora": asdict(config.lora)}
    report = base_report(description, splits, run, settings, clock)
    report |= {"speed": speed, "speed_rule": SPEED_RULE, "top1_agreement_with_float": agreement, "medusa": medusa}
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


@dataclass(slots=True)
class AdapterRun:
    """What the LoRA stage leaves: the adapted model (`trained`, a peft `PeftModel`), the `[rows, seq_len]` train and
    held-out ids, the evaluation sets by name and the held-out perplexities so far (stage -> set -> value)."""

    trained: LoraResult
    train_rows: torch.Tensor
    held_out: torch.Tensor
    eval_sets: dict[str, torch.Tensor]
    perplexities: dict[str, dict[str, float]]


def train_adapter(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, splits: DomainSplits,
                  config: FinetuneConfig, original_rows: torch.Tensor | None, clock: StageClock,
                  progress: bool = True) -> AdapterRun:
    """The stages every fine-tune runs: the rows of each split, the base's held-out perplexity, then LoRA training
    (`model` is wrapped in place by peft)."""
    with clock.stage("data"):
        lora = config.lora
        train_rows = text_rows(splits.train, tokenizer, config.seq_len, lora.steps * lora.batch_size)
        held_out = text_rows(splits.held_out, tokenizer, config.seq_len, config.eval_rows)
    eval_sets = {"domain": held_out} | ({} if original_rows is None else {"original": original_rows})
    perplexities = {"base": evaluate(model, eval_sets, clock, "evaluate base")}
    with clock.stage("lora"), tempfile.TemporaryDirectory() as scratch:
        trained = train_lora(model, train_rows, lora, scratch, progress)
    return AdapterRun(trained, train_rows, held_out, eval_sets, perplexities)


def evaluate(model: PreTrainedModel, eval_sets: dict[str, torch.Tensor], clock: StageClock,
             stage: str) -> dict[str, float]:
    """Held-out perplexity of `model` on each evaluation set, timed as `stage`."""
    with clock.stage(stage):
        return {name: round(held_out_perplexity(model, rows), 3) for name, rows in eval_sets.items()}


def _agreement(quantized: PreTrainedModel, merged: PreTrainedModel, rows: torch.Tensor, clock: StageClock) -> float:
    """Share of held-out positions where the quantized model's argmax equals the float model's (same prefix)."""
    with clock.stage("evaluate quantized"):
        return round(greedy_agreement(quantized, merged, rows), 4)


def _train_heads(model: PreTrainedModel, train_rows: torch.Tensor, config: FinetuneConfig,
                 init_heads: MedusaHeads | None, description: str, progress: bool) -> tuple[MedusaHeads, dict]:
    """Heads trained on the model's own greedy continuations of prompts from the train split."""
    started = time.perf_counter()
    rows = self_distilled_rows(model, train_rows[: config.self_distill_rows], progress=progress)
    generation_s = time.perf_counter() - started
    heads = None if init_heads is None else MedusaHeads(init_heads.config).float()
    if heads is not None:
        heads.load_state_dict(init_heads.state_dict())
    result = train_medusa(model, rows, heads=heads, progress=progress, steps=config.medusa_steps,
                          batch_size=config.medusa_batch_size, seq_len=config.seq_len, lr=config.medusa_lr,
                          distill="hard", warmup_steps=min(10, config.medusa_steps))
    result.heads.config.base_model_name_or_path = f"{description} fine-tuned".strip()
    return result.heads, {"steps": result.last_step, "self_distill_rows": int(rows.shape[0]),
                          "initialised_from": "given heads" if init_heads is not None else "the model's lm_head",
                          "final_loss": final_loss(result.losses, window=10),
                          "self_distillation_seconds": round(generation_s, 1),
                          "train_seconds": round(result.train_seconds, 1)}


def _speed(merged: PreTrainedModel, served: PreTrainedModel, heads: MedusaHeads, held_out: torch.Tensor,
           config: FinetuneConfig) -> list[dict]:
    sides = [Side("float, plain generate", merged), Side("float + Medusa", merged, heads)]
    if served is not merged:
        sides += [Side(f"{config.quant}, plain generate", served), Side(f"{config.quant} + Medusa", served, heads)]
    prompts = held_out[: config.speed_prompts, : config.prompt_len]
    return [result.as_row() for result in compare_speed(sides, prompts, config.new_tokens, config.repeats)]


SPEED_RULE = ("batch 1, greedy, exactly new_tokens tokens after prompt_len held-out tokens, prefill included; "
              "ratio = median over (repeat, prompt) of the first side's seconds / this side's; agreement = share of "
              "generated tokens equal to the first side's")


def base_report(description: str, splits: DomainSplits, run: AdapterRun, settings: dict[str, Any],
                clock: StageClock) -> dict[str, Any]:
    """The report fields every fine-tune writes: model, data, `settings`, perplexities, LoRA training, times."""
    trained = run.trained
    return {
        "model": description,
        "data": {"source": "long descriptions in the METADATA of installed distributions (English prose about "
                           "software); train and held-out split by distribution",
                 "train_distributions": len(splits.train.sources), "held_out_distributions": splits.held_out.sources,
                 "train_rows": int(run.train_rows.shape[0]), "held_out_rows": int(run.held_out.shape[0]),
                 "seq_len": int(run.train_rows.shape[1])},
        "settings": settings,
        "perplexity": run.perplexities,
        "lora": {"trainable_parameters": trained.num_trainable_parameters, "losses": trained.losses,
                 "train_seconds": round(trained.train_seconds, 1)},
        "times_s": clock.seconds | {"total": round(sum(clock.seconds.values()), 1)},
        "hardware": hardware(),
    }


__all__ = ["AdapterRun", "FinetuneConfig", "HEADS_DIR", "REPORT_NAME", "StageClock", "base_report", "evaluate",
           "run_finetune", "train_adapter"]
