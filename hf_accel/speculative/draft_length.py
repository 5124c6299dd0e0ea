"""Adaptive draft length: how many tokens the draft proposes next round."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DraftLength:
    """Draft length k for the next round, adapted after every round.

    Rule (transformers' "heuristic" schedule, extended to batches): when some generating row accepted all k drafts,
    k grows by 2 (up to `max_tokens`); otherwise it shrinks by 1 (down to 1). A batch advances its caches by the
    longest accepted run, so the best row, not the worst, decides whether longer drafts pay off. `num_tokens` is the
    starting k.
    """

    num_tokens: int = 4
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"`max_draft_tokens` must be >= 1, got {self.max_tokens}")
        if not 1 <= self.num_tokens <= self.max_tokens:
            raise ValueError(f"`num_draft_tokens` must be in 1..max_draft_tokens={self.max_tokens}, got {self.num_tokens}")

    def next(self, budget: int) -> int:
        """k for a round in which no row may gain more than `budget` tokens (k + 1 tokens at most)."""
        return max(min(self.num_tokens, budget - 1), 0)

    def update(self, k: int, most_accepted: int) -> None:
        """After a round that proposed `k` drafts, the best generating row accepting `most_accepted` of them."""
        if k == 0:
            return
        if most_accepted >= k:
            self.num_tokens = min(self.num_tokens + 2, self.max_tokens)
        else:
            self.num_tokens = max(self.num_tokens - 1, 1)
