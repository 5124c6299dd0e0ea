"""Adaptive draft length: how many candidates a chain drafter (draft model, EAGLE head) drafts per row next round."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DraftLength:
    """Candidates per row k for the next round, adapted after every round.

    Rule (transformers' "heuristic" schedule, extended to batches): when every generating row accepted all k
    candidates, k grows by 2 (up to `max_tokens`); otherwise it shrinks by 1 (down to 1). At batch size > 1 the
    worst row decides: the verification forward scores rows x (k + 1) tokens, and once that is compute-bound (CPU,
    or large batches) candidates that only one row keeps cost more than they save (docs/speculative.md, "Adaptive
    draft length"). `num_tokens` is the starting k.
    """

    num_tokens: int = 4
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"`max_draft_tokens` must be >= 1, got {self.max_tokens}")
        if not 1 <= self.num_tokens <= self.max_tokens:
            raise ValueError(f"`num_draft_tokens` must be in 1..max_draft_tokens={self.max_tokens}, got "
                             f"{self.num_tokens}")

    def next(self, budget: int) -> int:
        """k for a round in which no row may gain more than `budget` tokens (k + 1 tokens at most)."""
        return max(min(self.num_tokens, budget - 1), 0)

    def update(self, k: int, fewest_accepted: int) -> None:
        """After a round that drafted `k` candidates per row, every generating row accepting at least
        `fewest_accepted`."""
        if k == 0:
            return
        if fewest_accepted >= k:
            self.num_tokens = min(self.num_tokens + 2, self.max_tokens)
        else:
            self.num_tokens = max(self.num_tokens - 1, 1)
