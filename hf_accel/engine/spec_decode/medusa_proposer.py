"""Medusa candidates in the engine (`SpeculativeConfig(method="medusa", model=heads)`).

Rules:
- candidates are a top-1 chain: head j's argmax on the hidden state that produced the sequence's last token is
  candidate j + 1 (head j predicts the token j + 2 after that position);
- only plain-greedy sequences speculate (the heads are trained on greedy continuations): the proposer keeps its own
  state per sequence, the hidden state that produced the sequence's last token, kept after each step for
  plain-greedy sequences and dropped when the sequence ends (`forget`).
Verification, rollback and counters are the engine's (`engine/commit.py`, `Scheduler.postprocess`).
"""

from __future__ import annotations

import torch

from ...speculative.medusa_heads import MedusaHeads
from ..model_runner import StepOutput
from ..scheduler import ScheduledBatch
from ..sequence import Sequence
from .proposer import Proposer


class MedusaProposer(Proposer):
    """Proposes top-1 candidate chains with the first `num_speculative_tokens` of `heads`, run as one batched
    forward (`MedusaHeads.stacked`: a snapshot, later changes to `heads` are not seen)."""

    needs_hidden = True

    def __init__(self, heads: MedusaHeads, num_speculative_tokens: int | None = None):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"`medusa_heads` must be a hf_accel.MedusaHeads, got {type(heads).__name__}")
        k = heads.num_heads if num_speculative_tokens is None else num_speculative_tokens
        if k > heads.num_heads:
            raise ValueError(f"`num_speculative_tokens` must be at most the heads' {heads.num_heads}, got {k}")
        self.num_speculative_tokens = k
        self.heads = heads.stacked(k)
        self._hidden: dict[int, torch.Tensor] = {}  # seq_id -> [hidden_size] state that produced its last token

    @property
    def num_tracked(self) -> int:
        return len(self._hidden)

    def can_propose(self, seq: Sequence) -> bool:
        """Whether the heads can propose for `seq` now: plain greedy, it can speculate and its last token's state is
        known."""
        return seq.can_speculate and not seq.params.needs_processing and seq.seq_id in self._hidden

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Keep `hidden` `[hidden_size]`, the state that produced `seq`'s last token (plain-greedy sequences only:
        candidates are verified greedily)."""
        if not seq.params.needs_processing:
            self._hidden[seq.seq_id] = hidden

    def observe_step(self, batch: ScheduledBatch, out: StepOutput, num_accepted: dict[int, int],
                     seconds: float) -> None:
        """`observe` each sampling sequence still running with the state that produced its new last token: the row
        of its last token's, moved on by the candidates it kept."""
        for i, scheduled in enumerate(out.sampling):
            seq = scheduled.seq
            if not seq.is_finished:
                self.observe(seq, out.hidden[out.starts[i] + num_accepted[seq.seq_id]])

    def forget(self, seq: Sequence) -> None:
        self._hidden.pop(seq.seq_id, None)

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Per sequence, the `num_drafts[i]` candidates of the first heads on its kept state (one batched forward of
        the most heads asked for)."""
        hidden = torch.stack([self._hidden[seq.seq_id] for seq in seqs])  # [rows, hidden_size]
        with torch.inference_mode():
            chains = self.heads(hidden, max(num_drafts)).argmax(dim=-1).T.tolist()  # [width, rows] -> [rows][width]
        return [chain[:n] for chain, n in zip(chains, num_drafts)]
