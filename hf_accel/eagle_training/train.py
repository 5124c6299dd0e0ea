"""Training an EAGLE head on a frozen target: `train_eagle(model, dataset, ...)`.

The target runs once over the training rows (`features.target_features`); then each step unrolls the head for
`unroll_steps` draft steps over a batch of rows (`unroll.py`, EAGLE-3's training-time test) and minimises the
cross-entropy of every step's logits against the target's greedy next token, step j weighted `step_decay ** j`.
Checkpoints (head + optimizer + schedule + step) make a run resumable with identical batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.settings import check_int
from ..medusa_training.train import token_rows
from ..speculative.eagle_head import EagleHead
from .features import TargetFeatures, target_features
from .unroll import unrolled_hidden, unrolled_loss

CHECKPOINT_STATE = "trainer_state.pt"


@dataclass(slots=True)
class EagleTrainConfig:
    """Settings of `train_eagle` (pass them as keyword arguments).

    Args:
        steps: optimizer steps in all (a resumed run continues up to this many).
        batch_size, seq_len: rows of `seq_len` tokens per step.
        lr, weight_decay, warmup_steps: AdamW with linear warmup, then cosine decay to 10% at `steps`.
        unroll_steps: draft steps trained per position (training-time test), >= 1.
        step_decay: loss weight of draft step j is `step_decay ** j`, in (0, 1].
        dtype: "fp32" or "bf16" (CPU/CUDA autocast for the head; master weights stay fp32).
        time_budget_s: stop early after this many seconds of training.
        checkpoint_every: steps between checkpoints into `output_dir/step-N` (0: only the end, into `output_dir`).
        seed: data order.
    """

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    unroll_steps: int = 5
    step_decay: float = 0.8
    dtype: Literal["fp32", "bf16"] = "fp32"
    time_budget_s: float | None = None
    checkpoint_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "unroll_steps"):
            check_int(name, getattr(self, name), 1, "an int >= 1")
        check_int("seq_len", self.seq_len, self.unroll_steps + 2, f"an int >= unroll_steps + 2 = "
                                                                     f"{self.unroll_steps + 2}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"`step_decay` must be in (0, 1], got {self.step_decay}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"`dtype` must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("`lr` must be positive, `warmup_steps` and `checkpoint_every` non-negative")


@dataclass(slots=True)
class EagleTrainResult:
    """What a run produced: the head, the loss and per-step top-1 accuracy of every step run now (`losses[i]` is
    step `first_step + i`), and the seconds spent on target features and on training."""

    head: EagleHead
    first_step: int
    last_step: int
    losses: list[float] = field(default_factory=list)
    accuracies: list[list[float]] = field(default_factory=list)
    feature_seconds: float = 0.0
    train_seconds: float = 0.0


def train_eagle(
    model: PreTrainedModel,
    dataset: Any,
    tokenizer: PreTrainedTokenizerBase | None = None,
    head: EagleHead | None = None,
    output_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
    progress: bool = True,
    **options: Any,
) -> EagleTrainResult:
    """Train an EAGLE head for the frozen `model` on `dataset` (the forms `medusa_training.train.token_rows`
    accepts: texts, id lists, a `datasets.Dataset`, a `[rows, >= seq_len]` tensor; best: the model's own greedy
    output, `medusa_training.train.self_distilled_rows`).

    `options` are `EagleTrainConfig` fields. `head`: start from it (default `EagleHead.for_model(model)`).
    `output_dir`: the final head and its trainer state go there, every `checkpoint_every` steps a checkpoint into
    `output_dir/step-N`. `resume_from`: one of those folders; training continues at its step with the same batches
    and learning rates (give the same `steps`: the schedule's length).
    """
    config = EagleTrainConfig(**options)
    rows = token_rows(dataset, config.seq_len, tokenizer, model.generation_config.eos_token_id)
    model.eval().requires_grad_(False)
    head, optimizer, schedule, step = _start(model, head, config, resume_from)
    started = time.perf_counter()
    features = target_features(model, rows, head.config.feature_layers, progress=progress)
    result = EagleTrainResult(head, step, step, feature_seconds=time.perf_counter() - started)
    started = time.perf_counter()
    budget = float("inf") if config.time_budget_s is None else config.time_budget_s
    bar = tqdm(total=config.steps, initial=step, desc="train-eagle", disable=not progress)
    while step < config.steps and time.perf_counter() - started < budget:
        _record(result, bar, *_train_step(model, head, optimizer, features, step, config))
        schedule.step()
        step += 1
        if output_dir is not None and config.checkpoint_every and step % config.checkpoint_every == 0:
            save_checkpoint(Path(output_dir) / f"step-{step}", head, optimizer, schedule, step)
    bar.close()
    result.last_step, result.train_seconds = step, time.perf_counter() - started
    if output_dir is not None:
        save_checkpoint(Path(output_dir), head, optimizer, schedule, step)
    head.eval()
    return result


def _record(result: EagleTrainResult, bar: tqdm, loss: float, accuracy: list[float]) -> None:
    result.losses.append(loss)
    result.accuracies.append(accuracy)
    bar.update()
    bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{accuracy[0]:.2f}", acc_last=f"{accuracy[-1]:.2f}")


def batch_rows(num_rows: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Row indices of step `step`: epochs of a seeded permutation, so a resumed run sees the same batches."""
    per_epoch = max(num_rows // batch_size, 1)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    take = order[index * batch_size : (index + 1) * batch_size]
    return take if take.numel() else order[:batch_size]


def save_checkpoint(folder: Path, head: EagleHead, optimizer, schedule, step: int) -> None:
    """The head (`save_pretrained`) plus `trainer_state.pt` (optimizer, schedule, next step) in `folder`."""
    head.save_pretrained(folder)
    state = {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": step}
    torch.save(state, Path(folder) / CHECKPOINT_STATE)


def _start(model: PreTrainedModel, head: EagleHead | None, config: EagleTrainConfig, resume_from):
    if resume_from is not None:
        head = EagleHead.from_pretrained(resume_from, model, dtype=torch.float32)
    elif head is None:
        head = EagleHead.for_model(model).float()
    head.check_compatible(model)
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config))
    if resume_from is None:
        return head, optimizer, schedule, 0
    state = torch.load(Path(resume_from) / CHECKPOINT_STATE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return head, optimizer, schedule, int(state["step"])


def _lr_factor(step: int, config: EagleTrainConfig) -> float:
    # linear warmup, then cosine from 1 down to 0.1 at the last step
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = min((step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1), 1.0)
    return 0.1 + 0.45 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())


def _train_step(model: PreTrainedModel, head: EagleHead, optimizer, features: TargetFeatures, step: int,
                config: EagleTrainConfig) -> tuple[float, list[float]]:
    device = head.fc.weight.device
    ids, hidden, labels = features.rows(batch_rows(features.num_rows, step, config.batch_size, config.seed), device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.dtype == "bf16"):
        outputs = unrolled_hidden(model, head, hidden, ids, config.unroll_steps)
        loss, accuracy = unrolled_loss(model, head, outputs, labels, config.step_decay)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach()), accuracy


__all__ = ["EagleTrainConfig", "EagleTrainResult", "train_eagle"]
