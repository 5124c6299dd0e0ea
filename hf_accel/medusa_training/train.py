"""Training Medusa heads on a frozen model (Medusa-1): `train_medusa(model, dataset, ...)`.

The base model runs under `no_grad`; only the heads learn. At position t, head k (0-based) is trained on token
t+2+k: the text's own token, or with `distill="hard"` the base model's argmax for that position (its prediction
given the true prefix), or with `distill="soft"` its whole distribution (KL). The loss is
`sum_k decay_factor**k * loss_k`. Checkpoints (heads + optimizer + step) make a run resumable with identical batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.settings import check_int
from ..reference.corpus import pack_sequences
from ..speculative.medusa_heads import MedusaHeads

CHECKPOINT_STATE = "trainer_state.pt"


@dataclass(slots=True)
class MedusaTrainConfig:
    """Settings of `train_medusa` (pass them as keyword arguments).

    Args:
        num_heads, num_layers: shape of new heads (ignored when `heads` are given).
        steps: optimizer steps in all (a resumed run continues up to this many).
        batch_size, seq_len: rows of `seq_len` tokens per step.
        lr, weight_decay, warmup_steps: AdamW with linear warmup, then constant.
        decay_factor: loss weight of head k is `decay_factor ** k`, in (0, 1].
        distill: "none" (text tokens), "hard" (base argmax) or "soft" (base distribution) targets.
        dtype: "fp32" or "bf16" (CPU/CUDA autocast for base and heads; master weights stay fp32).
        time_budget_s: stop early after this many seconds of training.
        checkpoint_every: steps between checkpoints into `output_dir` (0: only at the end).
        seed: data order and head initialisation.
    """

    num_heads: int = 4
    num_layers: int = 1
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    decay_factor: float = 0.8
    distill: Literal["none", "hard", "soft"] = "none"
    dtype: Literal["fp32", "bf16"] = "fp32"
    time_budget_s: float | None = None
    checkpoint_every: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "steps", "batch_size"):
            check_int(name, getattr(self, name), 1, "an int >= 1")
        if self.seq_len < self.num_heads + 2:
            raise ValueError(f"`seq_len` must be at least num_heads + 2 = {self.num_heads + 2}, got {self.seq_len}")
        if not 0 < self.decay_factor <= 1:
            raise ValueError(f"`decay_factor` must be in (0, 1], got {self.decay_factor}")
        if self.distill not in ("none", "hard", "soft"):
            raise ValueError(f"`distill` must be 'none', 'hard' or 'soft', got {self.distill!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"`dtype` must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.lr <= 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("`lr` must be positive, `warmup_steps` and `checkpoint_every` non-negative")


@dataclass(slots=True)
class MedusaTrainResult:
    """What a run produced: the heads, the loss of every step run now (`losses[i]` is step `first_step + i`)."""

    heads: MedusaHeads
    first_step: int
    last_step: int
    losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0


def token_rows(
    dataset: Any, seq_len: int, tokenizer: PreTrainedTokenizerBase | None = None, separator_id: int | None = None
) -> torch.Tensor:
    """`[rows, seq_len]` training ids from a `datasets.Dataset` (column "input_ids" or "text"), a list of texts, a
    list of id lists, or a `[rows, >= seq_len]` tensor. Documents are joined with `separator_id` (default: the
    tokenizer's EOS) and cut into rows."""
    if isinstance(dataset, torch.Tensor):
        if dataset.dim() != 2 or dataset.shape[1] < seq_len:
            raise ValueError(f"a tensor `dataset` must be [rows, >= seq_len={seq_len}], got {tuple(dataset.shape)}")
        return dataset[:, :seq_len].long()
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None:  # a datasets.Dataset
        column = "input_ids" if "input_ids" in column_names else "text"
        if column not in column_names:
            raise ValueError(f"`dataset` needs an 'input_ids' or 'text' column, has {column_names}")
        dataset = dataset[column]
    items = list(dataset)
    if not items:
        raise ValueError("`dataset` is empty")
    if isinstance(items[0], str):
        if tokenizer is None:
            raise ValueError("a `dataset` of text needs `tokenizer=`")
        items = tokenizer(items, add_special_tokens=False)["input_ids"]
    separator = separator_id if separator_id is not None else getattr(tokenizer, "eos_token_id", None)
    rows = pack_sequences([list(ids) for ids in items], 0 if separator is None else separator, seq_len)
    if rows.shape[0] == 0:
        raise ValueError(f"`dataset` holds fewer than seq_len={seq_len} tokens")
    return rows


@torch.no_grad()
def self_distilled_rows(model: PreTrainedModel, rows: torch.Tensor, prompt_len: int = 32, batch_size: int = 64,
                        progress: bool = False) -> torch.Tensor:
    """The model's own greedy continuations of the first `prompt_len` tokens of each of `rows` `[n, seq]`, as
    `[n, seq]` training rows (Medusa's self-distillation data: what greedy decoding will ask the heads to guess)."""
    device, seq_len, out = next(model.parameters()).device, rows.shape[1], []
    for start in tqdm(range(0, rows.shape[0], batch_size), desc="self-distillation data", disable=not progress):
        prompts = rows[start : start + batch_size, :prompt_len].to(device)
        out.append(model.generate(prompts, max_new_tokens=seq_len - prompt_len, min_new_tokens=seq_len - prompt_len,
                                  do_sample=False, eos_token_id=None, pad_token_id=0).cpu())
    return torch.cat(out)


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


def _autocast(config: MedusaTrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.dtype == "bf16")


def _base_forward(model: PreTrainedModel, ids: torch.Tensor, config: MedusaTrainConfig):
    # frozen base: last (normed) hidden state [batch, seq, hidden] and, for distillation, its logits
    with torch.no_grad(), _autocast(config, ids.device):
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False,
                    logits_to_keep=0 if config.distill != "none" else 1)
    return out.hidden_states[-1].float(), out.logits if config.distill != "none" else None


def _batch(rows: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The rows of step `step`: epochs of a seeded permutation, so a resumed run sees the same batches."""
    per_epoch = max(rows.shape[0] // batch_size, 1)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
    take = order[index * batch_size : (index + 1) * batch_size]
    return rows[take if take.numel() else order[:batch_size]]


def _optimizer(heads: MedusaHeads, config: MedusaTrainConfig) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(config.warmup_steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, schedule


def save_checkpoint(folder: Path, heads: MedusaHeads, optimizer, schedule, step: int) -> None:
    """Heads (`save_pretrained`) plus `trainer_state.pt` (optimizer, schedule, next step) in `folder`."""
    heads.save_pretrained(folder)
    state = {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": step}
    torch.save(state, Path(folder) / CHECKPOINT_STATE)


def train_medusa(
    model: PreTrainedModel,
    dataset: Any,
    tokenizer: PreTrainedTokenizerBase | None = None,
    heads: MedusaHeads | None = None,
    output_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
    progress: bool = True,
    **options: Any,
) -> MedusaTrainResult:
    """Train Medusa heads for the frozen `model` on `dataset` (see `token_rows` for the accepted forms).

    `options` are `MedusaTrainConfig` fields (steps, batch_size, seq_len, lr, decay_factor, distill, dtype, ...).
    `heads`: start from these (default: `MedusaHeads.for_model(model, num_heads, num_layers)`). `output_dir`: where
    checkpoints and the final heads go. `resume_from`: a checkpoint folder; training continues at its step.
    """
    config = MedusaTrainConfig(**options)
    rows = token_rows(dataset, config.seq_len, tokenizer, model.generation_config.eos_token_id)
    heads, optimizer, schedule, step = _start(model, heads, config, resume_from)
    result = MedusaTrainResult(heads=heads, first_step=step, last_step=step)
    device = next(model.parameters()).device
    model.eval().requires_grad_(False)
    started = time.perf_counter()
    bar = tqdm(total=config.steps, initial=step, desc="train-medusa", disable=not progress)
    budget = float("inf") if config.time_budget_s is None else config.time_budget_s
    while step < config.steps and time.perf_counter() - started < budget:
        ids = _batch(rows, step, config.batch_size, config.seed).to(device)
        result.losses.append(_train_step(model, heads, optimizer, ids, config))
        schedule.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
        if output_dir is not None and config.checkpoint_every and step % config.checkpoint_every == 0:
            save_checkpoint(Path(output_dir), heads, optimizer, schedule, step)
    bar.close()
    result.last_step, result.train_seconds = step, time.perf_counter() - started
    if output_dir is not None:
        save_checkpoint(Path(output_dir), heads, optimizer, schedule, step)
    heads.eval()
    return result


def _start(model, heads, config, resume_from):
    if resume_from is not None:
        heads = MedusaHeads.from_pretrained(resume_from, dtype=torch.float32, device=next(model.parameters()).device)
    elif heads is None:
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            heads = MedusaHeads.for_model(model, config.num_heads, config.num_layers).float()
    heads.check_compatible(model)
    heads.train()
    optimizer, schedule = _optimizer(heads, config)
    if resume_from is None:
        return heads, optimizer, schedule, 0
    state = torch.load(Path(resume_from) / CHECKPOINT_STATE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return heads, optimizer, schedule, int(state["step"])


def _train_step(model, heads: MedusaHeads, optimizer, ids: torch.Tensor, config: MedusaTrainConfig) -> float:
    hidden, base_logits = _base_forward(model, ids, config)
    with _autocast(config, ids.device):
        head_logits = heads(hidden)
    loss, _ = medusa_loss(head_logits, ids, base_logits, config)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


__all__ = ["MedusaTrainConfig", "MedusaTrainResult", "self_distilled_rows", "token_rows", "train_medusa"]
