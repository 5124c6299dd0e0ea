"""The seam between the engine and a speculative method: a `Proposer` per method (built by `make_proposer`), and
`NullProposer` when the engine does not speculate.

A new method is one class with these members (and a line in `make_proposer`); the engine does the rest (scheduling
the candidates, verifying them, rolling back rejected K/V, counting). The engine always has a proposer: without
speculation the scheduler gives no sequence room for candidates, so the null one is never asked to propose, and its
hooks do nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..model_runner import StepOutput
from ..scheduler import ScheduledBatch
from ..sequence import Sequence


class Proposer(Protocol):
    """Proposes candidate tokens to follow the last token of decoding sequences. A class that subclasses it inherits
    the defaults: no hidden states or features asked of the step, no K/V pool of its own, nothing learnt.

    `needs_hidden`: the step must return the final hidden state of each sampled position (`observe_step` gets them
    in `out.hidden`).
    `feature_layers`: the step must return these `output_hidden_states` entries at every token it computes
    (`take_features` gets the committed ones; empty: not needed).
    A proposer that keeps K/V of its own in a pool addressed by the target's block tables (an EAGLE head, a draft
    model) counts it in `kv_bytes_per_token` (the engine's K/V budget covers it), gets it from `allocate` once the
    engine has sized its own pool, and reports the seconds it compiled in `compile_seconds`.
    """

    needs_hidden: bool = False
    feature_layers: tuple[int, ...] = ()
    compile_seconds: float = 0.0

    @property
    def num_tracked(self) -> int:
        """Sequences it keeps state for (0 once every request has finished: nothing leaks)."""

    def can_propose(self, seq: Sequence) -> bool:
        """Whether the scheduler should make room for candidates after `seq`'s last token this step."""

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Per sequence, at most `num_drafts[i]` candidates to follow its `token_ids` (fewer, or none: it decodes
        plainly in the same step)."""

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes per token of its own K/V pool (0: none)."""
        return 0

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, attend,
                 compile: bool = False) -> None:
        """Its pool of the target's `num_blocks` blocks of `block_size`, attended by `attend` (with `compile`, its
        forward compiled as the engine's step is); nothing without a pool."""

    def take_features(self, committed: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """After a step: per scheduled sequence, the first position it committed and the features there `[n, F]`
        (at `feature_layers`; called only when those are not empty)."""

    def observe_step(self, batch: ScheduledBatch, out: StepOutput, num_accepted: dict[int, int],
                     seconds: float) -> None:
        """After a step whose tokens are committed: `batch` as it ran (`num_drafts`: the candidates each verified),
        its kept rows `out`, the candidates each sampling sequence kept by `seq_id` (those that finished or failed
        are finished by now), and the seconds the model's forward took."""

    def forget(self, seq: Sequence) -> None:
        """`seq` has finished (done, aborted or failed): drop what is kept for it."""


class NullProposer(Proposer):
    """No speculation: no sequence can propose, nothing is kept."""

    num_tracked = 0

    def can_propose(self, seq: Sequence) -> bool:
        return False

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        return [[] for _ in seqs]

