"""`SpecDecodeStats`: what the engine's verification counted since start, as vLLM's `spec_decode_*` metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start: rounds (`num_drafts`: a sequence verifying candidates in a step), candidates proposed
    and accepted (bonus tokens not counted), and accepted candidates by position (`accepted_per_position[j]`: rounds
    whose candidate j, 0 first, was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Count one round that verified `num_drafted` candidates and accepted the first `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if num_drafted > len(self.accepted_per_position):
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
