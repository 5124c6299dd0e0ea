"""Held-out metrics for the reference models: perplexity, and the draft's greedy agreement with the target."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def perplexity(model: nn.Module, sequences: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over every position of ``sequences`` ``[rows, seq_len]`` but the first
    of each row."""
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for batch in sequences.split(batch_size):
        logits = model(input_ids=batch).logits.float()  # [batch, seq, vocab]
        nll = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
        )
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


@torch.no_grad()
def greedy_agreement(draft: nn.Module, target: nn.Module, sequences: torch.Tensor, batch_size: int = 8) -> float:
    """Fraction of positions of ``sequences`` ``[rows, seq_len]`` where the draft's argmax next token equals the
    target's: the acceptance rate of one greedy speculative token given the same prefix."""
    draft.eval()
    target.eval()
    matches, total = 0, 0
    for batch in sequences.split(batch_size):
        draft_tokens = draft(input_ids=batch).logits.argmax(-1)  # [batch, seq]
        target_tokens = target(input_ids=batch).logits.argmax(-1)
        matches += (draft_tokens == target_tokens).sum().item()
        total += batch.numel()
    return matches / total
