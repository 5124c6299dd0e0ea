"""What a speculative generation measured: target forwards, tokens emitted, acceptance per draft position."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..display import RichDisplay


@dataclass(slots=True, repr=False)
class SpeculativeStats(RichDisplay):
    """Counters filled in by a speculative `generate` call that is handed this object (`draft_stats=`).

    Counts are over rows that were still generating; a call adds to the counters, so one object can sum a run.
    `proposed[j]` / `accepted[j]`: drafts proposed / accepted at draft position j (0 = first after the last token).
    """

    num_target_forwards: int = 0  # verification forwards (the prefill is not counted)
    num_draft_forwards: int = 0
    num_emitted: int = 0  # tokens emitted by verification forwards, over all rows
    num_row_rounds: int = 0  # (row, verification forward) pairs
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # k of every round, in order

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a row gains per target forward (1.0 for plain decoding)."""
        return self.num_emitted / self.num_row_rounds if self.num_row_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts, all positions together."""
        proposed = sum(self.proposed)
        return sum(self.accepted) / proposed if proposed else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft j accepted | it was proposed), per draft position j."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def summary(self) -> dict[str, object]:
        """Forwards, tokens per forward and acceptance (what `repr` and the Jupyter table show)."""
        return {"target_forwards": self.num_target_forwards, "draft_forwards": self.num_draft_forwards,
                "tokens_emitted": self.num_emitted, "tokens_per_forward": self.tokens_per_forward,
                "acceptance_rate": self.acceptance_rate, "acceptance_by_position": self.acceptance_by_position}

    def record_round(self, k: int, num_accepted: torch.Tensor, num_emitted: torch.Tensor, active: torch.Tensor) -> None:
        """One verification forward: `num_accepted`, `num_emitted` and `active` (rows generating) are `[batch]`."""
        self.num_target_forwards += 1
        self.draft_lengths.append(k)
        rows = active.nonzero().squeeze(1)
        accepted = num_accepted[rows].tolist()
        self.num_emitted += int(num_emitted[rows].sum())
        self.num_row_rounds += len(accepted)
        grow = k - len(self.proposed)
        if grow > 0:
            self.proposed.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for n in accepted:  # a row that accepted n drafts had positions 0..n accepted, n rejected (when n < k)
            for j in range(min(n + 1, k)):
                self.proposed[j] += 1
                self.accepted[j] += int(j < n)
