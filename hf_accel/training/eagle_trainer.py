"""Training an EAGLE head on a frozen target: `train_eagle(model, dataset, ...)`.

The target runs once over the training rows (`eagle_features.target_features`); then each step unrolls the head for
`unroll_steps` draft steps over a batch of rows (`eagle_unroll.py`, EAGLE-3's training-time test) and minimises the
cross-entropy of every step's logits against the target's greedy next token, step j weighted `step_decay ** j`.
The steps, their schedule (warmup, then cosine) and resumable checkpoints are `train_loop.run_steps`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.settings import check_int
from ..speculative.eagle_head import EagleHead
from .data import batch_indices, token_rows
from .eagle_features import TargetFeatures, target_features
from .eagle_unroll import unrolled_hidden, unrolled_loss
from .train_loop import HeadTrainConfig, HeadTraining, LoopRules, StepLoss, cosine_after_warmup, run_steps

EAGLE_LOOP = LoopRules("train-eagle", max_grad_norm=1.0, step_folders=True)


@dataclass(slots=True)
class EagleTrainConfig(HeadTrainConfig):
    """Settings of `train_eagle` (pass them as keyword arguments): those of `HeadTrainConfig` (steps, batch_size,
    seq_len, lr, weight_decay, warmup_steps, dtype, time_budget_s, checkpoint_every, seed; after warmup the learning
    rate decays on a cosine to 10% at `steps`; checkpoints go into `output_dir/step-N`), plus:

    Args:
        unroll_steps: draft steps trained per position (training-time test), >= 1.
        step_decay: loss weight of draft step j is `step_decay ** j`, in (0, 1].
    """

    unroll_steps: int = 5
    step_decay: float = 0.8

    def __post_init__(self) -> None:
        check_int("unroll_steps", self.unroll_steps, 1, "an int >= 1")
        HeadTrainConfig.__post_init__(self)  # explicit: zero-argument super() fails in slots dataclasses
        check_int("seq_len", self.seq_len, self.unroll_steps + 2, f"an int >= unroll_steps + 2 = "
                                                                     f"{self.unroll_steps + 2}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"`step_decay` must be in (0, 1], got {self.step_decay}")


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


def train_eagle(model: PreTrainedModel, dataset: Any, tokenizer: PreTrainedTokenizerBase | None = None,
                head: EagleHead | None = None, output_dir: str | Path | None = None,
                resume_from: str | Path | None = None, progress: bool = True, **options: Any) -> EagleTrainResult:
    """Train an EAGLE head for the frozen `model` on `dataset` (the forms `data.token_rows` accepts: texts, id
    lists, a `datasets.Dataset`, a `[rows, >= seq_len]` tensor; best: the model's own greedy output,
    `data.self_distilled_rows`).

    `options` are `EagleTrainConfig` fields. `head`: start from it (default `EagleHead.for_model(model)`).
    `output_dir`: the final head and its trainer state go there, every `checkpoint_every` steps a checkpoint into
    `output_dir/step-N`. `resume_from`: one of those folders; training continues at its step with the same batches
    and learning rates (give the same `steps`: the schedule's length).
    """
    config = EagleTrainConfig(**options)
    rows = token_rows(dataset, config.seq_len, tokenizer, model.generation_config.eos_token_id)
    model.eval().requires_grad_(False)
    head = _initial_head(model, head, resume_from)
    training = HeadTraining.start(head, config, cosine_after_warmup(config), resume_from)
    started = time.perf_counter()
    features = target_features(model, rows, head.config.feature_layers, progress=progress)
    feature_seconds = time.perf_counter() - started

    def step_loss(step: int) -> StepLoss:
        return _step_loss(model, head, features, step, config)

    run = run_steps(training, config, EAGLE_LOOP, step_loss, output_dir, progress)
    return EagleTrainResult(head, run.first_step, run.last_step, run.losses, run.accuracies, feature_seconds,
                            run.seconds)


def _initial_head(model: PreTrainedModel, head: EagleHead | None, resume_from: str | Path | None) -> EagleHead:
    if resume_from is not None:
        head = EagleHead.from_pretrained(resume_from, model, dtype=torch.float32)
    elif head is None:
        head = EagleHead.for_model(model).float()
    head.check_compatible(model)
    return head


def _step_loss(model: PreTrainedModel, head: EagleHead, features: TargetFeatures, step: int,
               config: EagleTrainConfig) -> StepLoss:
    device = head.fc.weight.device
    ids, hidden, labels = features.rows(batch_indices(features.num_rows, step, config.batch_size, config.seed), device)
    with config.autocast(device):
        outputs = unrolled_hidden(model, head, hidden, ids, config.unroll_steps)
        loss, accuracy = unrolled_loss(model, head, outputs, labels, config.step_decay)
    return StepLoss(loss, accuracy)


__all__ = ["EagleTrainConfig", "EagleTrainResult", "train_eagle"]
