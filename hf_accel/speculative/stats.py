"""`SpeculativeStats`: what a speculative `generate` call measured, one record for every drafter (draft model, EAGLE
head, Medusa heads, n-gram matcher).

Tokens per forward, the one definition: tokens a row gains per verification forward of the target, over rows still
generating; the prefill (which makes each row's first token, as plain decoding does) is not counted. Plain decoding
gives 1.0; speculation gives 1 + the candidates accepted per round (vLLM's mean acceptance length, the engine's
1 + `spec_decode_num_accepted_tokens` / `spec_decode_num_drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..display import RichDisplay


@dataclass(slots=True, repr=False)
class SpeculativeStats(RichDisplay):
    """Counters filled in by a speculative `generate` call that is handed this object (`draft_stats=` of
    `draft_generate`, `medusa_stats=` of `medusa_generate`).

    Counts are over rows that were still generating; a call adds to the counters, so one object can sum a run.
    A round is one row of one verification forward. `proposed[j]` / `accepted[j]`: rounds that reached candidate
    position j (0 = first after the last token: a draft's first token, a Medusa tree's depth 1) / accepted it.
    """

    num_target_forwards: int = 0  # verification forwards (the prefill is not counted)
    num_draft_forwards: int = 0  # forwards of the draft model, or of the Medusa heads
    num_emitted: int = 0  # tokens emitted by verification forwards, over all rows
    num_row_rounds: int = 0  # (row, verification forward) pairs
    num_new_tokens: int = 0  # tokens returned per row, summed over rows (the prefill's first token included)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # candidates per row of every round (or row round), in order

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a row gains per target verification forward, the prefill not counted (1.0 for plain decoding)."""
        return self.num_emitted / self.num_row_rounds if self.num_row_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted candidates / candidates reached, all positions together."""
        proposed = sum(self.proposed)
        return sum(self.accepted) / proposed if proposed else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(candidate j accepted | its position was reached), per position j."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def summary(self) -> dict[str, object]:
        """Forwards, tokens per forward and acceptance (what `repr` and the Jupyter table show)."""
        return {"target_forwards": self.num_target_forwards, "draft_forwards": self.num_draft_forwards,
                "tokens_emitted": self.num_emitted, "tokens_per_forward": self.tokens_per_forward,
                "acceptance_rate": self.acceptance_rate, "acceptance_by_position": self.acceptance_by_position}

    def record_round(self, depth: int, num_accepted: torch.Tensor, num_emitted: torch.Tensor, active: torch.Tensor,
                     num_candidates: int | None = None, row_depths: torch.Tensor | None = None) -> None:
        """One verification forward of candidates `depth` positions deep (`num_candidates` per row, default `depth`:
        a Medusa tree holds more): `num_accepted`, `num_emitted` and `active` (rows generating) are `[batch]`.
        `row_depths`: `[batch]` chain each row really drafted, when rows differ (`draft_lengths` then gets one entry
        per generating row)."""
        self.num_target_forwards += 1
        rows = active.nonzero().squeeze(1)
        accepted = num_accepted[rows].tolist()
        depths = [depth] * len(accepted) if row_depths is None else row_depths[rows].tolist()
        if row_depths is None:
            self.draft_lengths.append(depth if num_candidates is None else num_candidates)
        else:
            self.draft_lengths.extend(depths)
        self.num_emitted += int(num_emitted[rows].sum())
        self.num_row_rounds += len(accepted)
        grow = depth - len(self.proposed)
        if grow > 0:
            self.proposed.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for n, row_depth in zip(accepted, depths):  # n accepted: positions 0..n reached, 0..n-1 accepted
            for j in range(min(n + 1, row_depth)):
                self.proposed[j] += 1
                self.accepted[j] += int(j < n)

