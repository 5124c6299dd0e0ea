"""Medusa speculation inside the engine: candidates from the heads, greedy verification, vLLM's counters.

A speculating decode computes its last token and `k` candidates in one packed row; the target's logits at those
`1 + k` positions decide. Rules:
- candidates are a top-1 chain: head j's argmax on the hidden state that produced the sequence's last token is
  candidate j + 1 (head j predicts the token j + 2 after that position);
- verification is `speculative.verify.greedy_accept`: the candidates equal to the target's argmax at the position
  before them, then the target's own token at the first mismatch (or after the last candidate: the bonus token), so
  the output is exactly plain greedy decoding's; the engine appends them one at a time under every stop rule;
- K/V written for rejected candidates is garbage past the committed length: `num_computed_tokens` is rolled back
  to the committed tokens, so the prefix cache indexes only committed blocks and later steps overwrite the slots;
- the proposer keeps its own state per sequence: the hidden state that produced the sequence's last token, kept
  after each step for plain-greedy sequences and dropped when the sequence ends (`forget`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..speculative.medusa_heads import MedusaHeads
from .sequence import Sequence


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start, as vLLM's `spec_decode_*` metrics: verification rounds (`num_drafts`), candidates
    proposed and candidates accepted (bonus tokens not counted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted


class MedusaProposer:
    """Proposes top-1 candidate chains with the first `num_speculative_tokens` of `heads`, run as one batched
    forward (`MedusaHeads.stacked`: a snapshot, later changes to `heads` are not seen)."""

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
        """Whether the heads can propose for `seq` now: it can speculate and its last token's state is known."""
        return seq.can_speculate and seq.seq_id in self._hidden

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Keep `hidden` `[hidden_size]`, the state that produced `seq`'s last token (plain-greedy sequences only:
        candidates are verified greedily)."""
        if not seq.params.needs_processing:
            self._hidden[seq.seq_id] = hidden

    def forget(self, seq: Sequence) -> None:
        self._hidden.pop(seq.seq_id, None)

    def propose(self, seqs: list[Sequence], width: int) -> list[list[int]]:
        """Per sequence, the `width` candidates of the first `width` heads on its kept state."""
        hidden = torch.stack([self._hidden[seq.seq_id] for seq in seqs])  # [rows, hidden_size]
        with torch.inference_mode():
            return self.heads(hidden, width).argmax(dim=-1).T.tolist()  # [width, rows] -> [rows][width]
