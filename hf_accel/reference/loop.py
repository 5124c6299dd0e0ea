"""The reference models' training loop: seeded init, AdamW with warmup + cosine, bf16 autocast, tqdm progress."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from .presets import ModelPreset, TrainRecipe

SAVE_DTYPE = torch.bfloat16


@dataclass(slots=True)
class TrainResult:
    """What one training run did: ``losses[i]`` is the train loss of step ``i``."""

    steps_done: int
    seconds: float
    tokens_seen: int
    losses: list[float]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_seen / self.seconds if self.seconds > 0 else 0.0

    def final_loss(self, window: int = 20) -> float:
        """Mean train loss over the last ``window`` steps."""
        tail = self.losses[-window:]
        return sum(tail) / len(tail) if tail else math.nan


def lr_at(step: int, recipe: TrainRecipe) -> float:
    """Learning rate at 0-based ``step``: linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr``."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def build_model(preset: ModelPreset, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama of the preset's shape, over the tokenizer's vocabulary."""
    torch.manual_seed(seed)
    config = preset.to_config(len(tokenizer), tokenizer.eos_token_id)
    return LlamaForCausalLM(config)


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def _optimizer(model: torch.nn.Module, recipe: TrainRecipe) -> torch.optim.AdamW:
    # weight decay on matrices only; norms' scales are left alone
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95))


def _batches(sequences: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    # epochs of a seeded shuffle; a batch never spans two epochs
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(sequences), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield sequences[order[start : start + batch_size]]


def train_model(
    model: LlamaForCausalLM,
    sequences: torch.Tensor,
    recipe: TrainRecipe,
    time_budget_s: float | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train on packed ``sequences`` ``[rows, seq_len]`` for ``recipe.steps`` steps, or until ``time_budget_s``
    seconds have passed (the schedule stays the one of ``recipe.steps``; the result says where it stopped)."""
    if sequences.shape[1] != recipe.seq_len or len(sequences) < recipe.batch_size:
        shape = tuple(sequences.shape)
        raise ValueError(f"sequences must hold >= {recipe.batch_size} rows of {recipe.seq_len} tokens, got {shape}")
    model.train()
    optimizer = _optimizer(model, recipe)
    batches = _batches(sequences, recipe.batch_size, recipe.seed)
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(recipe.steps), desc="train", unit="step", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        batch = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.bf16_autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr_at(step, recipe):.2e}", refresh=False)
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
    bar.close()
    steps_done = len(losses)
    seconds = time.perf_counter() - start
    return TrainResult(steps_done, seconds, steps_done * recipe.batch_size * recipe.seq_len, losses)


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, folder: Path) -> Path:
    """Save a ``SAVE_DTYPE`` copy of the model as safetensors, plus the tokenizer, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(SAVE_DTYPE).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
