"""The loop the head trainers plug their loss into (`medusa_trainer.py`, `eagle_trainer.py`).

A trainer builds its module, starts a `HeadTraining` (AdamW over the module, a `LambdaLR` schedule, the next step;
restored from a checkpoint folder when resuming) and hands `run_steps` a function that returns the loss of step s
(`StepLoss`). Rules of the loop:
- step s runs while s < `steps` and the seconds since the loop began are below `time_budget_s`;
- a step: zero the gradients, backward, clip the gradient norm (when the trainer's `LoopRules` say so), optimizer
  step, schedule step; its loss (and the trainer's top-1 accuracies) go into `StepsRun` and onto a tqdm bar;
- with an output folder: a checkpoint every `checkpoint_every` steps (into the folder, or `folder/step-N`) and one
  into the folder at the end. A checkpoint is the module (`save_pretrained`) plus `trainer_state.pt` (optimizer,
  schedule, next step): a run resumed from it sees the same batches (`data.batch_indices`) and learning rates.

The reference models' trainer has a loop of its own (`reference_trainer.py`): its budget counts the time before a
resume, its learning rate follows the clock, and its checkpoint is one file that holds the losses so far.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from ..cache.settings import check_int

CHECKPOINT_STATE = "trainer_state.pt"


@dataclass(slots=True)
class HeadTrainConfig:
    """Settings every head trainer shares (`train_medusa` and `train_eagle` take them as keyword arguments).

    Args:
        steps: optimizer steps in all (a resumed run continues up to this many).
        batch_size, seq_len: rows of `seq_len` tokens per step.
        lr, weight_decay, warmup_steps: AdamW, its learning rate reached linearly over `warmup_steps`; after that
            the trainer's schedule (`constant_after_warmup` or `cosine_after_warmup`).
        dtype: "fp32" or "bf16" (CPU/CUDA autocast; master weights stay fp32).
        time_budget_s: stop early after this many seconds of training.
        checkpoint_every: steps between checkpoints into the output folder (0: only at the end).
        seed: data order.
    """

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    dtype: Literal["fp32", "bf16"] = "fp32"
    time_budget_s: float | None = None
    checkpoint_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            check_int(name, getattr(self, name), 1, "an int >= 1")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"`dtype` must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("`lr` must be positive, `warmup_steps` and `checkpoint_every` non-negative")

    def autocast(self, device: torch.device) -> torch.autocast:
        """bf16 autocast on `device` when `dtype` is "bf16", else a disabled one."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.dtype == "bf16")


def constant_after_warmup(config: HeadTrainConfig) -> Callable[[int], float]:
    """Learning-rate factor of step s: linear warmup over `warmup_steps` (at least 1), then 1."""
    warmup = max(config.warmup_steps, 1)
    return lambda step: min(1.0, (step + 1) / warmup)


def cosine_after_warmup(config: HeadTrainConfig) -> Callable[[int], float]:
    """Learning-rate factor of step s: linear warmup over `warmup_steps`, then cosine from 1 down to 0.1 at
    `steps`."""
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min((step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1), 1.0)
        return 0.1 + 0.45 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

    return factor


@dataclass(frozen=True, slots=True)
class LoopRules:
    """What differs between the head trainers' loops: the progress bar's name, gradient-norm clipping (None: none)
    and where periodic checkpoints go (`folder/step-N` when `step_folders`, else `folder` itself)."""

    name: str
    max_grad_norm: float | None = None
    step_folders: bool = False

    def checkpoint_folder(self, folder: Path, step: int) -> Path:
        """Where the checkpoint after `step` steps goes when the output folder is `folder`."""
        return folder / f"step-{step}" if self.step_folders else folder


@dataclass(slots=True)
class StepLoss:
    """One step's loss to minimise (a scalar tensor) and, if the trainer measures them, top-1 accuracies."""

    loss: torch.Tensor
    accuracy: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepsRun:
    """What `run_steps` did: `losses[i]` and `accuracies[i]` are step `first_step + i`'s; `seconds` of training."""

    first_step: int
    last_step: int
    losses: list[float] = field(default_factory=list)
    accuracies: list[list[float]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(slots=True)
class HeadTraining:
    """A module being trained (a `MedusaHeads` or `EagleHead`: it has `save_pretrained`), its optimizer and
    schedule, and the step it runs next."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    step: int = 0

    @classmethod
    def start(cls, module: torch.nn.Module, config: HeadTrainConfig, lr_factor: Callable[[int], float],
              resume_from: str | Path | None = None) -> HeadTraining:
        """`module` in train mode under AdamW with the schedule `lr_factor`; optimizer, schedule and step restored
        from `resume_from`'s `trainer_state.pt` when given (the module's weights are the caller's to load)."""
        module.train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        training = cls(module, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor))
        if resume_from is not None:
            state = torch.load(Path(resume_from) / CHECKPOINT_STATE, weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            training.schedule.load_state_dict(state["schedule"])
            training.step = int(state["step"])
        return training

    def save(self, folder: Path) -> None:
        """The module (`save_pretrained`) plus `trainer_state.pt` (optimizer, schedule, next step) in `folder`."""
        self.module.save_pretrained(folder)
        state = {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(), "step": self.step}
        torch.save(state, Path(folder) / CHECKPOINT_STATE)

    def take_step(self, step: StepLoss, max_grad_norm: float | None) -> None:
        """Minimise `step.loss` by one optimizer step, then advance the schedule and the step count."""
        self.optimizer.zero_grad(set_to_none=True)
        step.loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        self.step += 1


def run_steps(training: HeadTraining, config: HeadTrainConfig, rules: LoopRules, step_loss: Callable[[int], StepLoss],
              output_dir: str | Path | None = None, progress: bool = True) -> StepsRun:
    """Train from `training.step` up to `config.steps` (see the module docstring); `step_loss(s)` is step s's loss.
    Leaves the module in eval mode."""
    run = StepsRun(training.step, training.step)
    started = time.perf_counter()
    budget = math.inf if config.time_budget_s is None else config.time_budget_s
    bar = tqdm(total=config.steps, initial=training.step, desc=rules.name, disable=not progress)
    while training.step < config.steps and time.perf_counter() - started < budget:
        step = step_loss(training.step)
        training.take_step(step, rules.max_grad_norm)
        _log(run, bar, float(step.loss.detach()), step.accuracy)
        if output_dir is not None and config.checkpoint_every and training.step % config.checkpoint_every == 0:
            training.save(rules.checkpoint_folder(Path(output_dir), training.step))
    bar.close()
    run.last_step, run.seconds = training.step, time.perf_counter() - started
    if output_dir is not None:
        training.save(Path(output_dir))
    training.module.eval()
    return run


def _log(run: StepsRun, bar: tqdm, loss: float, accuracy: list[float]) -> None:
    run.losses.append(loss)
    bar.update()
    if not accuracy:
        bar.set_postfix(loss=f"{loss:.3f}")
        return
    run.accuracies.append(accuracy)
    bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{accuracy[0]:.2f}", acc_last=f"{accuracy[-1]:.2f}")


def final_loss(losses: list[float], window: int = 20) -> float | None:
    """Mean of the last `window` losses, rounded to 4 decimals; None when no step ran."""
    tail = losses[-window:]
    return round(sum(tail) / len(tail), 4) if tail else None


__all__ = ["HeadTrainConfig", "HeadTraining", "LoopRules", "StepLoss", "StepsRun", "constant_after_warmup",
           "cosine_after_warmup", "final_loss", "run_steps"]
