"""Jump-forward decoding for constrained sequences, in front of the engine's proposer.

Where a sequence's grammar allows exactly one continuation (a JSON key after `{"`, `": "` after it, the closing
brackets), those tokens (`TokenMatcher.forced_tokens`) are its candidates this step, verified by the same forward as
any proposer's: each is kept only where the target's grammar-masked choice there is that token (greedy) or accepts
it (sampling, one-hot draft distribution), so outputs stay exactly those of constrained plain decoding; the grammar
may allow another tokenization of the forced text, which the target then picks. Up to `MAX_FORCED_TOKENS` per
step, whatever the step's `draft_width` (forced tokens are verified nearly always and cost the forward a few
columns); it is on for every constrained request (unless its `StructuredOutput(jump_forward=False)`), with or without
a `SpeculativeConfig`. Sequences without forced tokens go to the proposer as before.
"""

from __future__ import annotations

from ..sequence import Sequence
from .proposer import Proposer

# forced candidates per sequence and step (bench_structured, batch 1, forced text in the model's own spelling:
# 4 1.45x, 8 1.44x, 2 1.14x constrained decoding without them)
MAX_FORCED_TOKENS = 4
MAX_FORCED_BATCH_TOKENS = 32  # decodes x (1 + forced) per step at most: a large batch is compute-bound (batch 64
# with forced tokens ran 0.84x without); batch 8 takes 3 each (1.51x constrained plain decoding, 1.43x at 2 each on an
# AMD EPYC, where a step's fixed cost is a larger share than on the Xeon that chose 2)


class JumpForward:
    """Candidates per sequence: its grammar's forced tokens when it has some (and `enabled`), else `proposer`'s."""

    def __init__(self, proposer: Proposer, enabled: bool = True):
        self.proposer, self.enabled = proposer, enabled
        self.num_forced_tokens = 0  # forced candidates proposed since start

    def room(self, seq: Sequence, width: int, num_decodes: int) -> int:
        """Candidates `seq` wants this step (the scheduler's hook): its forced tokens, as many as let `num_decodes` x
        (1 + forced) fit `MAX_FORCED_BATCH_TOKENS` (up to `MAX_FORCED_TOKENS`), else `width` if the proposer can
        propose for it."""
        room = min(MAX_FORCED_TOKENS, MAX_FORCED_BATCH_TOKENS // max(num_decodes, 1) - 1)
        forced = self._forced(seq) if room > 0 else []
        if forced:
            return min(len(forced), room)
        return width if width and self.proposer.can_propose(seq) else 0

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Per sequence, at most `num_drafts[i]` candidates: forced tokens, or the proposer's (batched)."""
        proposals: list[list[int]] = [[] for _ in seqs]
        others = []
        for i, seq in enumerate(seqs):
            forced = self._forced(seq)
            if forced:
                proposals[i] = forced[: num_drafts[i]]
                self.num_forced_tokens += len(proposals[i])
            else:
                others.append(i)
        if others:
            for i, proposal in zip(others, self.proposer.propose([seqs[i] for i in others],
                                                                 [num_drafts[i] for i in others])):
                proposals[i] = proposal
        return proposals

    def _forced(self, seq: Sequence) -> list[int]:
        if not self.enabled or seq.grammar is None or not seq.params.structured_outputs.jump_forward:
            return []
        return seq.grammar.forced_tokens()
