"""The seam between the engine and a speculative method: a `Proposer` per method, built from a `SpeculativeConfig`.

A new method is one class with these members (and a line in `make_proposer`); the engine does the rest (scheduling the
candidates, verifying them, rolling back rejected K/V, counting).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from transformers import PreTrainedModel

from .draft_proposer import DraftProposer
from .eagle_proposer import EagleProposer
from .medusa_proposer import MedusaProposer
from .scheduler import ScheduledBatch
from .sequence import Sequence
from .speculative_config import SpeculativeConfig
from .suffix_proposer import SuffixProposer


class Proposer(Protocol):
    """Proposes candidate tokens to follow the last token of decoding sequences.

    `needs_hidden`: the step must return the final hidden state of each sampled position (`observe` gets them).
    `feature_layers`: the step must return these `output_hidden_states` entries at every token it computes
    (`take_features` gets the committed ones; empty: not needed).
    `has_pool`: it keeps K/V of its own in a pool addressed by the target's block tables (an EAGLE head, a draft
    model); it then also has `allocate` (the pool, sized like the target's: the engine calls it once its own pool is
    sized), `kv_bytes_per_token` (counted in the engine's K/V budget) and `compile_seconds`.
    """

    needs_hidden: bool
    feature_layers: tuple[int, ...]
    has_pool: bool

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

    def take_features(self, committed: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """After a step: per scheduled sequence, the first position it committed and the features there `[n, F]`
        (at `feature_layers`; called only when those are not empty)."""

    def observe_step(self, batch: ScheduledBatch, num_accepted: dict[int, int], seconds: float) -> None:
        """After a step whose tokens are committed: `batch` as it ran (`num_drafts`: the candidates each verified),
        the candidates each kept by `seq_id`, and the seconds the model's forward took (what a proposer that sizes
        its drafts by cost learns from)."""

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


def make_proposer(config: SpeculativeConfig, model: PreTrainedModel) -> Proposer:
    """The proposer of `config.method` for the served `model`."""
    if config.method == "medusa":
        return MedusaProposer(config.model, config.num_candidates)
    if config.method == "eagle3":
        return EagleProposer(config.model, model, config.num_candidates)
    if config.method == "draft":
        return DraftProposer(config.model, model, config.num_candidates)
    return SuffixProposer(config)
