"""Shared helpers for the engine tests: reference outputs from plain `generate`, one request at a time."""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel

from conformance import FIRST_WORD, VOCAB_SIZE


def random_prompts(lengths: list[int], seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    """Token-id prompts of the given lengths over the tiny vocabulary's word ids."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_WORD, vocab_size) for _ in range(n)] for n in lengths]


def greedy_reference(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate` greedy continuation of one unpadded prompt (no early stop), new tokens only."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def top2_gap(model: PreTrainedModel, tokens: list[int]) -> float:
    """Gap between the two best next-token logits after `tokens` (plain forward, no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_equal(model: PreTrainedModel, prompt: list[int], got: list[int], expected: list[int],
                        tie_atol: float = 1e-4) -> None:
    """Tokens equal, or first differ only at a near tie of the reference's two best logits (batched matmuls round
    differently from one-row ones; a tie within `tie_atol` may flip either way)."""
    if got == expected:
        return
    step = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b) if len(got) == len(expected) else None
    assert step is not None, f"lengths differ: {len(got)} vs {len(expected)}"
    gap = top2_gap(model, prompt + expected[:step])
    assert gap <= tie_atol, f"first difference at step {step} with a top-2 logit gap of {gap:.2e}: {got} vs {expected}"
