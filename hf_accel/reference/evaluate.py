"""Held-out metrics for the reference models: perplexity, the draft's greedy agreement with the target, and the
time of one decoding step of each."""

from __future__ import annotations

import math
import statistics
import time

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


@torch.no_grad()
def token_forward_seconds(target: nn.Module, draft: nn.Module, context: torch.Tensor,
                          steps: int = 48) -> tuple[float, float]:
    """Median seconds of one single-token forward (batch 1, a KV cache of ``context`` ``[1, len]`` tokens) of the
    target and of the draft, the two timed alternately so that load on a shared machine hits both alike."""
    caches = [model(input_ids=context, use_cache=True).past_key_values for model in (target, draft)]
    token = context[:, -1:]
    times: list[list[float]] = [[], []]
    for _ in range(steps):
        for i, model in enumerate((target, draft)):
            start = time.perf_counter()
            model(input_ids=token, past_key_values=caches[i], use_cache=True)
            times[i].append(time.perf_counter() - start)
            caches[i].crop(-1)  # drop the new token: the same context length at every step
    return statistics.median(times[0]), statistics.median(times[1])
