"""`MedusaStats`: what a `medusa_generate` call's tree steps gained, counted per row so batches compare with batch 1."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..display import RichDisplay


@dataclass(slots=True, repr=False)
class MedusaStats(RichDisplay):
    """Counters a caller may pass as `medusa_stats=` to see how speculation went (filled in place, added to by
    every call it is passed to). A row step is one row of one target forward, counted while the row still
    generates."""

    num_new_tokens: int = 0  # over all rows
    num_verify_forwards: int = 0  # tree forwards after the prefill
    num_verify_rows: int = 0  # row steps of those forwards
    num_sequences: int = 0  # rows prefilled (each prefill makes one token per row, as a plain step does)
    accepted_per_depth: list[int] = field(default_factory=list)  # [depth-1] row steps that accepted a depth-d node
    candidates_per_step: list[int] = field(default_factory=list)  # candidates per row verified by each tree forward

    @property
    def tokens_per_step(self) -> float:
        """New tokens per row step (the prefill included, as plain decoding makes one token per row per forward)."""
        return self.num_new_tokens / max(self.num_verify_rows + self.num_sequences, 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Candidates accepted at depth d per row step, d = 1.. (head d-1's hit rate on the accepted path)."""
        return [n / self.num_verify_rows if self.num_verify_rows else 0.0 for n in self.accepted_per_depth]

    def summary(self) -> dict[str, object]:
        """Tokens, forwards, tokens per step, acceptance per depth (what `repr` and the Jupyter table show)."""
        candidates = self.candidates_per_step
        return {"new_tokens": self.num_new_tokens, "verify_forwards": self.num_verify_forwards,
                "tokens_per_step": self.tokens_per_step, "acceptance_by_depth": self.acceptance_by_depth,
                "mean_candidates": sum(candidates) / len(candidates) if candidates else 0.0}
