"""Training Medusa heads on a frozen model (Medusa-1): `train_medusa(model, dataset, ...)`.

The base model runs under `no_grad`; only the heads learn. At position t, head k (0-based) is trained on token
t+2+k: the text's own token, or with `distill="hard"` the base model's argmax for that position (its prediction
given the true prefix), or with `distill="soft"` its whole distribution (KL). The loss is
`sum_k decay_factor**k * loss_k`; the steps, their schedule (warmup, then constant) and resumable checkpoints are
`train_loop.run_steps`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.settings import check_int
from ..speculative.medusa_heads import MedusaHeads
from .data import batch_indices, token_rows
from .train_loop import HeadTrainConfig, HeadTraining, LoopRules, StepLoss, constant_after_warmup, run_steps

MEDUSA_LOOP = LoopRules("train-medusa")


@dataclass(slots=True)
class MedusaTrainConfig(HeadTrainConfig):
    """Settings of `train_medusa` (pass them as keyword arguments): those of `HeadTrainConfig` (steps, batch_size,
    seq_len, lr, weight_decay, warmup_steps, dtype, time_budget_s, checkpoint_every, seed; the learning rate stays
    constant after warmup; `seed` also initialises new heads), plus:

    Args:
        num_heads, num_layers: shape of new heads (ignored when `heads` are given).
        decay_factor: loss weight of head k is `decay_factor ** k`, in (0, 1].
        distill: "none" (text tokens), "hard" (base argmax) or "soft" (base distribution) targets.
    """

    num_heads: int = 4
    num_layers: int = 1
    decay_factor: float = 0.8
    distill: Literal["none", "hard", "soft"] = "none"

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers"):
            check_int(name, getattr(self, name), 1, "an int >= 1")
        HeadTrainConfig.__post_init__(self)  # explicit: zero-argument super() fails in slots dataclasses
        if self.seq_len < self.num_heads + 2:
            raise ValueError(f"`seq_len` must be at least num_heads + 2 = {self.num_heads + 2}, got {self.seq_len}")
        if not 0 < self.decay_factor <= 1:
            raise ValueError(f"`decay_factor` must be in (0, 1], got {self.decay_factor}")
        if self.distill not in ("none", "hard", "soft"):
            raise ValueError(f"`distill` must be 'none', 'hard' or 'soft', got {self.distill!r}")


@dataclass(slots=True)
class MedusaTrainResult:
    """What a run produced: the heads, the loss of every step run now (`losses[i]` is step `first_step + i`)."""

    heads: MedusaHeads
    first_step: int
    last_step: int
    losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0


def medusa_loss(
    head_logits: torch.Tensor, input_ids: torch.Tensor, base_logits: torch.Tensor | None, config: MedusaTrainConfig
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted loss and per-head losses. `head_logits`: `[K, batch, seq, vocab]`; `input_ids`: `[batch, seq]`;
    `base_logits` `[batch, seq, vocab]` (needed for distillation): position t of head k is scored against token
    t+2+k, whose base prediction sits at position t+1+k."""
    per_head = []
    for k, logits in enumerate(head_logits):
        shift = k + 2
        predicted = logits[:, :-shift].float().flatten(0, 1)
        if config.distill == "none":
            loss = F.cross_entropy(predicted, input_ids[:, shift:].flatten())
        elif config.distill == "hard":
            loss = F.cross_entropy(predicted, base_logits[:, shift - 1 : -1].argmax(-1).flatten())
        else:
            teacher = F.log_softmax(base_logits[:, shift - 1 : -1].float().flatten(0, 1), dim=-1)
            loss = F.kl_div(F.log_softmax(predicted, dim=-1), teacher, log_target=True, reduction="batchmean")
        per_head.append(loss)
    total = sum(config.decay_factor**k * loss for k, loss in enumerate(per_head))
    return total, per_head


def train_medusa(model: PreTrainedModel, dataset: Any, tokenizer: PreTrainedTokenizerBase | None = None,
                 heads: MedusaHeads | None = None, output_dir: str | Path | None = None,
                 resume_from: str | Path | None = None, progress: bool = True, **options: Any) -> MedusaTrainResult:
    """Train Medusa heads for the frozen `model` on `dataset` (see `data.token_rows` for the accepted forms).

    `options` are `MedusaTrainConfig` fields (steps, batch_size, seq_len, lr, decay_factor, distill, dtype, ...).
    `heads`: start from these (default: `MedusaHeads.for_model(model, num_heads, num_layers)`). `output_dir`: where
    checkpoints and the final heads go. `resume_from`: a checkpoint folder; training continues at its step.
    """
    config = MedusaTrainConfig(**options)
    rows = token_rows(dataset, config.seq_len, tokenizer, model.generation_config.eos_token_id)
    start = _initial_heads(model, heads, config, resume_from)
    training = HeadTraining.start(start, config, constant_after_warmup(config), resume_from)
    device = next(model.parameters()).device
    model.eval().requires_grad_(False)

    def step_loss(step: int) -> StepLoss:
        ids = rows[batch_indices(rows.shape[0], step, config.batch_size, config.seed)].to(device)
        return StepLoss(_loss(model, training.module, ids, config))

    run = run_steps(training, config, MEDUSA_LOOP, step_loss, output_dir, progress)
    return MedusaTrainResult(training.module, run.first_step, run.last_step, run.losses, run.seconds)


def _initial_heads(model: PreTrainedModel, heads: MedusaHeads | None, config: MedusaTrainConfig,
                   resume_from: str | Path | None) -> MedusaHeads:
    if resume_from is not None:
        heads = MedusaHeads.from_pretrained(resume_from, dtype=torch.float32, device=next(model.parameters()).device)
    elif heads is None:
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            heads = MedusaHeads.for_model(model, config.num_heads, config.num_layers).float()
    heads.check_compatible(model)
    return heads


def _loss(model: PreTrainedModel, heads: MedusaHeads, ids: torch.Tensor, config: MedusaTrainConfig) -> torch.Tensor:
    # frozen base: last (normed) hidden state [batch, seq, hidden] and, for distillation, its logits
    with torch.no_grad(), config.autocast(ids.device):
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False,
                    logits_to_keep=0 if config.distill != "none" else 1)
    base_logits = out.logits if config.distill != "none" else None
    with config.autocast(ids.device):
        head_logits = heads(out.hidden_states[-1].float())
    return medusa_loss(head_logits, ids, base_logits, config)[0]


__all__ = ["MedusaTrainConfig", "MedusaTrainResult", "medusa_loss", "train_medusa"]
