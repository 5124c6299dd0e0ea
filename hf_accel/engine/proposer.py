"""The seam between the engine and a speculative method: a `Proposer` per method, built from a `SpeculativeConfig`.

A new method is one class with these five members (and a line in `make_proposer`); the engine does the rest
(scheduling the candidates, verifying them, rolling back rejected K/V, counting).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .medusa_proposer import MedusaProposer
from .sequence import Sequence
from .speculative_config import SpeculativeConfig
from .suffix_proposer import SuffixProposer


class Proposer(Protocol):
    """Proposes candidate tokens to follow the last token of decoding sequences.

    `needs_hidden`: the step must return the final hidden state of each sampled position (`observe` gets them).
    """

    needs_hidden: bool

    @property
    def num_tracked(self) -> int:
        """Sequences it keeps state for (0 once every request has finished: nothing leaks)."""

    def can_propose(self, seq: Sequence) -> bool:
        """Whether the scheduler should make room for candidates after `seq`'s last token this step."""

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Per sequence, at most `num_drafts[i]` candidates to follow its `token_ids` (fewer, or none: it decodes
        plainly in the same step)."""

    def observe(self, seq: Sequence, hidden: torch.Tensor | None) -> None:
        """After a step appended tokens to `seq` (its accepted candidates and the target's token): `hidden`
        `[hidden_size]` is the state that produced its new last token (None unless `needs_hidden`)."""

    def forget(self, seq: Sequence) -> None:
        """`seq` has finished (done, aborted or failed): drop what is kept for it."""


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start, as vLLM's `spec_decode_*` metrics: verification rounds (`num_drafts`: a sequence verifying
    candidates in a step), candidates proposed and accepted (bonus tokens not counted), and accepted candidates by
    position (`accepted_per_position[j]`: rounds whose candidate j, 0 first, was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if num_drafted > len(self.accepted_per_position):
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of `config.method`."""
    if config.method == "medusa":
        return MedusaProposer(config.model, config.num_candidates)
    return SuffixProposer(config)
