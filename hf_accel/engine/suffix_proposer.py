"""Model-free candidates in the engine ("ngram" and "suffix"): n-gram matches in each sequence's own tokens, and for
"suffix" also in a `SuffixCache` of earlier requests' outputs that every request of the engine shares.

Rules:
- each decoding sequence has its own `NgramProposer` (its prompt and output in a suffix tree, grown as tokens are
  appended), created at its first proposal and dropped when it finishes (`forget`);
- a draft is kept only when it matched at least `prompt_lookup_min` tokens; drafts are cut where their estimated
  probability falls below `NgramSettings.min_probability` and after `tokens_per_match` tokens per matched token, so
  a sequence without a match proposes nothing and decodes plainly in the same step;
- "suffix": a sequence that finishes with "stop" or "length" adds its output to the shared cache.
"""

from __future__ import annotations

import torch

from ..speculative.ngram_proposer import NgramProposer
from ..speculative.suffix_cache import SuffixCache
from .sequence import Sequence
from .speculative_config import SpeculativeConfig


class SuffixProposer:
    """Prompt lookup ("ngram"), plus a shared `SuffixCache` of finished outputs ("suffix"), for every sequence."""

    needs_hidden = False
    has_pool = False
    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: SpeculativeConfig):
        self.settings = config.ngram_settings()
        self.min_match = config.lookup_min
        self.shared = None
        if config.method == "suffix":
            self.shared = SuffixCache(self.settings.max_depth, config.suffix_decoding_max_cached_requests)
        self._proposers: dict[int, NgramProposer] = {}  # seq_id -> its own tokens' proposer

    @property
    def num_tracked(self) -> int:
        return len(self._proposers)

    def can_propose(self, seq: Sequence) -> bool:
        return seq.can_speculate

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        return [self._propose_one(seq, n) for seq, n in zip(seqs, num_drafts)]

    def _propose_one(self, seq: Sequence, num_drafts: int) -> list[int]:
        proposer = self._proposers.get(seq.seq_id)
        if proposer is None:
            proposer = self._proposers[seq.seq_id] = NgramProposer(self.settings, self.shared)
        draft = proposer.propose(seq.token_ids, num_drafts)
        return draft.tokens if draft.match_length >= self.min_match else []

    def observe(self, seq: Sequence, hidden: torch.Tensor | None) -> None:
        """Nothing to keep: the next proposal reads the sequence's tokens."""

    def forget(self, seq: Sequence) -> None:
        self._proposers.pop(seq.seq_id, None)
        if self.shared is not None and seq.output.finish_reason in ("stop", "length") and seq.num_output_tokens:
            self.shared.add(seq.token_ids[seq.num_prompt_tokens :])
