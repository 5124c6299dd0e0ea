"""The reference models' trainer: seeded init, AdamW with warmup + cosine, optional bf16 autocast, tqdm progress,
and resumable checkpoints; batches in `data.seeded_batches` order.

A checkpoint (``<checkpoint_dir>/checkpoint.pt``, replaced atomically every ``checkpoint_every`` steps) holds the
model and optimizer states, the step, the losses so far and the seconds spent; resuming from it replays the seeded
batch order up to that step, so a resumed run sees the same batches as an uninterrupted one.

The loop is not the head trainers' `train_loop.run_steps`: the time budget here also counts the seconds spent before
a resume and is checked after each step (a fresh run takes at least one), the learning rate decays on the clock too
(`lr_at`), and the checkpoint is one file that carries the losses so far.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from .data import seeded_batches
from .reference_presets import ModelPreset, TrainRecipe

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


def lr_at(step: int, recipe: TrainRecipe, time_fraction: float = 0.0) -> float:
    """Learning rate at 0-based ``step``: linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr``.

    ``time_fraction`` (elapsed / time budget) lets a budgeted run decay on time: the decay follows whichever of
    steps and time is further along, so a run cut by its budget still ends at the floor learning rate."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    progress = max(progress, time_fraction)
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


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """Where ``train_model`` keeps its resumable state, how often (in steps) it saves, and whether to resume."""

    folder: Path
    every: int = 100
    resume: bool = False

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be a positive number of steps, got {self.every}")

    @property
    def path(self) -> Path:
        return Path(self.folder) / "checkpoint.pt"


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, losses: list[float],
                    seconds: float) -> None:
    """Write the resumable state to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "losses": losses, "seconds": seconds}
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[float], float]:
    """Restore model and optimizer from ``path``; returns the losses so far and the seconds already spent."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return list(state["losses"]), float(state["seconds"])


def _time_fraction(elapsed: float, budget: float | None) -> float:
    if budget is None:
        return 0.0
    return min(1.0, elapsed / budget) if budget > 0 else 1.0


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, averaged over positions (logits ``[batch, seq,
    vocab]``): the student learns the teacher's whole distribution, so its argmax, which greedy speculation accepts,
    follows the teacher's."""
    student = torch.nn.functional.log_softmax(student_logits.float().flatten(0, 1), dim=-1)
    teacher = torch.nn.functional.log_softmax(teacher_logits.float().flatten(0, 1), dim=-1)
    return torch.nn.functional.kl_div(student, teacher, reduction="batchmean", log_target=True)


def _step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor, recipe: TrainRecipe,
          lr: float, teacher: torch.nn.Module | None) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.bf16_autocast):
        if teacher is None:
            loss = model(input_ids=batch, labels=batch).loss
        else:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=batch).logits
            loss = distillation_loss(model(input_ids=batch).logits, teacher_logits)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _check_training(model: LlamaForCausalLM, sequences: torch.Tensor, recipe: TrainRecipe, skip_batches: int,
                    teacher: torch.nn.Module | None) -> None:
    """ValueError naming the argument that `train_model` cannot train with."""
    if skip_batches < 0:
        raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
    if teacher is not None and teacher.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"teacher's vocab_size {teacher.config.vocab_size} must equal the model's "
                         f"{model.config.vocab_size}")
    if sequences.shape[1] != recipe.seq_len or len(sequences) < recipe.batch_size:
        shape = tuple(sequences.shape)
        raise ValueError(f"sequences must hold >= {recipe.batch_size} rows of {recipe.seq_len} tokens, got {shape}")


def _starting_point(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, sequences: torch.Tensor,
                    recipe: TrainRecipe, time_budget_s: float | None, checkpointing: Checkpointing | None,
                    skip_batches: int) -> tuple[list[float], float, Iterator[torch.Tensor], range]:
    """(losses so far, seconds spent, the seeded batches positioned at the next step, the steps left): a fresh
    start, or the checkpoint's state when resuming."""
    losses, spent = [], 0.0
    if checkpointing is not None and checkpointing.resume and checkpointing.path.is_file():
        losses, spent = load_checkpoint(checkpointing.path, model, optimizer)
    batches = seeded_batches(sequences, recipe.batch_size, recipe.seed)
    for _ in range(skip_batches + len(losses)):  # replay the seeded order up to the resumed step
        next(batches)
    steps = range(len(losses), recipe.steps)
    if losses and time_budget_s is not None and spent >= time_budget_s:
        steps = range(0)  # resumed after the budget was spent: nothing left but saving and measuring
    return losses, spent, batches, steps


def train_model(
    model: LlamaForCausalLM,
    sequences: torch.Tensor,
    recipe: TrainRecipe,
    time_budget_s: float | None = None,
    progress: bool = True,
    checkpointing: Checkpointing | None = None,
    skip_batches: int = 0,
    teacher: torch.nn.Module | None = None,
) -> TrainResult:
    """Train on packed ``sequences`` ``[rows, seq_len]`` for ``recipe.steps`` steps, or until ``time_budget_s``
    seconds have passed (counting the time before a resume); with a budget the learning rate decays on time too
    (see ``lr_at``). ``checkpointing`` saves resumable state and, with ``resume``, continues from it.
    ``skip_batches`` passes over the first batches of the seeded order unseen: a model grown from one trained
    ``skip_batches`` steps with the same recipe seed then trains on rows it has never seen. With a ``teacher`` (a
    model over the same vocabulary, kept frozen) the loss is ``distillation_loss`` to its next-token distribution
    instead of cross-entropy on the text, and ``losses`` hold that."""
    _check_training(model, sequences, recipe, skip_batches, teacher)
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    model.train()
    optimizer = _optimizer(model, recipe)
    losses, spent, batches, steps = _starting_point(model, optimizer, sequences, recipe, time_budget_s,
                                                    checkpointing, skip_batches)
    start = time.perf_counter() - spent
    bar = tqdm(steps, desc="train", unit="step", disable=not progress)
    for step in bar:
        lr = lr_at(step, recipe, _time_fraction(time.perf_counter() - start, time_budget_s))
        losses.append(_step(model, optimizer, next(batches), recipe, lr, teacher))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}", refresh=False)
        out_of_time = time_budget_s is not None and time.perf_counter() - start > time_budget_s
        if checkpointing is not None and ((step + 1) % checkpointing.every == 0 or out_of_time):
            save_checkpoint(checkpointing.path, model, optimizer, losses, time.perf_counter() - start)
        if out_of_time:
            break
    bar.close()
    steps_done = len(losses)
    return TrainResult(steps_done, time.perf_counter() - start, steps_done * recipe.batch_size * recipe.seq_len, losses)


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, folder: Path) -> Path:
    """Save a ``SAVE_DTYPE`` copy of the model as safetensors, plus the tokenizer, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(SAVE_DTYPE).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
