"""LoRA fine-tuning in the ecosystem's own tools: a peft `LoraConfig`, transformers' `Trainer` on a
`datasets.Dataset`, then peft's `merge_and_unload` into a plain model.

    trained = train_lora(model, rows, LoraSettings(steps=40), output_dir="runs/lora")
    merged = merge_adapter(trained.model)      # the base architecture again, adapter folded into its weights

`train_lora` wraps `model` in place (peft injects LoRA layers into it): keep a copy if the base is needed later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel, PrinterCallback, Trainer, TrainingArguments, default_data_collator

from ..cache.settings import check_int

# every linear layer of a Llama-style block: attention and MLP
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class LoraSettings:
    """Adapter shape and training schedule of `train_lora`.

    Args:
        rank, alpha, dropout: the LoRA update `alpha / rank * B @ A` of rank `rank` on each target module.
        target_modules: names of the linear layers that get an adapter.
        steps, batch_size: optimizer steps, rows per step.
        lr, warmup_steps: AdamW learning rate, reached linearly over `warmup_steps`, then decayed linearly to 0.
        seed: adapter initialisation and data order.
    """

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    steps: int = 120
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "alpha", "steps", "batch_size"):
            check_int(name, getattr(self, name), 1, "an int >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError(f"`lr` must be positive and `warmup_steps` >= 0, got {self.lr}, {self.warmup_steps}")
        if not self.target_modules:
            raise ValueError("`target_modules` must name at least one module")

    def lora_config(self) -> LoraConfig:
        """The peft config of this adapter."""
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), task_type="CAUSAL_LM")


@dataclass(slots=True)
class LoraResult:
    """The model with its adapter (a peft `PeftModel`), the logged training losses and the training time."""

    model: PeftModel
    losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    num_trainable_parameters: int = 0


def training_arguments(settings: LoraSettings, output_dir: str | Path, device: torch.device,
                       progress: bool) -> TrainingArguments:
    """`TrainingArguments` for `settings`: no checkpoints, no reporting integrations, a loss logged every tenth
    of the run."""
    return TrainingArguments(
        output_dir=str(output_dir), max_steps=settings.steps, per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.lr, warmup_steps=settings.warmup_steps, lr_scheduler_type="linear",
        logging_steps=max(settings.steps // 10, 1), save_strategy="no", report_to="none", seed=settings.seed,
        data_seed=settings.seed, use_cpu=device.type == "cpu", disable_tqdm=not progress, dataloader_num_workers=0,
    )


def lm_dataset(rows: torch.Tensor) -> Dataset:
    """A `datasets.Dataset` of causal-LM examples from `[rows, seq_len]` ids (labels = inputs; the model shifts)."""
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise ValueError(f"`rows` must be a non-empty [rows, seq_len] tensor, got {tuple(rows.shape)}")
    ids = rows.tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def train_lora(model: PreTrainedModel, rows: torch.Tensor | Dataset, settings: LoraSettings | None = None,
               output_dir: str | Path = "lora-run", progress: bool = True) -> LoraResult:
    """Fine-tune a LoRA adapter on `rows` (`[rows, seq_len]` ids, or a `datasets.Dataset` with `input_ids` and
    `labels`) with transformers' `Trainer`; `model` is wrapped in place. Returns the adapted model in eval mode."""
    settings = settings or LoraSettings()
    dataset = rows if isinstance(rows, Dataset) else lm_dataset(rows)
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        adapted = get_peft_model(model, settings.lora_config())
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    args = training_arguments(settings, output_dir, next(model.parameters()).device, progress)
    trainer = Trainer(model=adapted, args=args, train_dataset=dataset, data_collator=default_data_collator)
    if not progress:
        trainer.remove_callback(PrinterCallback)  # it prints every logged loss when the tqdm bar is off
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return LoraResult(adapted.eval(), losses, seconds, trainable)


def merge_adapter(adapted: PeftModel) -> PreTrainedModel:
    """The base model with the adapter folded into its weights (`merge_and_unload`): plain transformers again."""
    return adapted.merge_and_unload().eval()


__all__ = ["DEFAULT_TARGET_MODULES", "LoraResult", "LoraSettings", "lm_dataset", "merge_adapter", "train_lora"]
