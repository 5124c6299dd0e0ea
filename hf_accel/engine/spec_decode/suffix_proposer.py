"""Model-free candidates in the engine ("ngram" and "suffix"): n-gram matches in each sequence's own tokens, and for
"suffix" also in a `SuffixCache` of earlier requests' outputs that every request of the engine shares.

Rules:
- each decoding sequence has its own `NgramDrafter` (its prompt and output in a suffix tree, grown as tokens are
  appended), created at its first proposal and dropped when it finishes (`forget`);
- a draft is kept only when it matched at least `prompt_lookup_min` tokens; drafts are cut where their estimated
  probability falls below `NgramSettings.min_probability` and after `tokens_per_match` tokens per matched token, so
  a sequence without a match proposes nothing and decodes plainly in the same step;
- how many of its candidates each sequence verifies is chosen over the whole step (`DraftBudget.choose_counts`,
  as `ngram_generate` chooses its rounds' k): candidates ranked by probability times the measured trust of their
  source, and the step verifies the best ones while expected tokens per second of the step rise, from what steps
  of that many decoding sequences were measured to cost by the tokens they forward (docs/serving.md, "The step's
  budget"); where nothing pays, the step decodes plainly, with a probe now and then (the off-switch);
- "suffix": a sequence that finishes with "stop" or "length" adds its output to the shared cache.
"""

from __future__ import annotations

from ...speculative.draft_budget import DraftBudget
from ...speculative.ngram_drafter import NgramDrafter
from ...speculative.suffix_cache import NO_DRAFT, Draft, SuffixCache
from ..model_runner import StepOutput
from ..scheduler import ScheduledBatch
from ..sequence import Sequence
from .proposer import Proposer
from .speculative_config import SpeculativeConfig


class SuffixProposer(Proposer):
    """Prompt lookup ("ngram"), plus a shared `SuffixCache` of finished outputs ("suffix"), for every sequence."""

    def __init__(self, config: SpeculativeConfig):
        self.settings = config.ngram_settings()
        self.min_match = config.lookup_min
        self.shared = None
        if config.method == "suffix":
            self.shared = SuffixCache(self.settings.max_depth, config.suffix_decoding_max_cached_requests)
        self.budget = DraftBudget(max_tokens=config.num_candidates)
        self._drafters: dict[int, NgramDrafter] = {}  # seq_id -> the drafter over its own tokens
        self._verifying: dict[int, Draft] = {}  # seq_id -> its draft in the step running now

    @property
    def num_tracked(self) -> int:
        return len(self._drafters)

    def can_propose(self, seq: Sequence) -> bool:
        return seq.can_speculate

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Each sequence's draft, cut to the count the step's budget gives it (see the module docstring)."""
        drafts = [self._draft(seq, n) for seq, n in zip(seqs, num_drafts)]
        counts = self.budget.choose_counts(drafts, len(seqs))
        self._verifying.update((seq.seq_id, draft) for seq, draft, count in zip(seqs, drafts, counts) if count)
        return [draft.tokens[:count] for draft, count in zip(drafts, counts)]

    def _draft(self, seq: Sequence, num_drafts: int) -> Draft:
        drafter = self._drafters.get(seq.seq_id)
        if drafter is None:
            drafter = self._drafters[seq.seq_id] = NgramDrafter(self.settings, self.shared)
        draft = drafter.draft(seq.token_ids, num_drafts)
        return draft if draft.match_length >= self.min_match else NO_DRAFT

    def observe_step(self, batch: ScheduledBatch, out: StepOutput, num_accepted: dict[int, int],
                     seconds: float) -> None:
        """Learn from the step that ran: the candidates its sequences kept against what their drafts expected
        (finished and failed sequences left out: a stop rule may have cut their tokens; so are rounds it did not
        propose, `JumpForward`'s), and, for a step of decodes only, its forward's seconds against the tokens it
        forwarded."""
        verified = [s for s in batch.scheduled  # its own rounds (not a grammar's forced tokens)
                    if s.num_drafts and s.seq.seq_id in self._verifying and not s.seq.is_finished]
        self.budget.learn([self._verifying[s.seq.seq_id] for s in verified], [s.num_drafts for s in verified],
                          [num_accepted[s.seq.seq_id] for s in verified])
        self._verifying = {}
        if all(s.num_new - s.num_drafts == 1 for s in batch.scheduled):  # one token each, and candidates
            rows = len(batch.scheduled)
            self.budget.cost(rows).observe(batch.num_tokens, rows, seconds)

    def forget(self, seq: Sequence) -> None:
        self._drafters.pop(seq.seq_id, None)
        self._verifying.pop(seq.seq_id, None)
        if self.shared is not None and seq.output.finish_reason in ("stop", "length") and seq.num_output_tokens:
            self.shared.add(seq.token_ids[seq.num_prompt_tokens :])
