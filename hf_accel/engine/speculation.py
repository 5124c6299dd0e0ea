"""Speculative decoding inside the engine: proposing candidates, verifying them, counting (vLLM's `spec_decode_*`).

A speculating decode computes its last token and its `k` candidates in one packed row (`k` may differ per row; a
row whose proposer has none decodes plainly in the same step); the target's logits at those `1 + k` positions
decide. Rules:
- verification keeps the output exactly what plain decoding gives (`speculative.verify`): plain-greedy rows take
  `greedy_accept` on the logits' argmax, batched by candidate count; rows with logits processors (penalties,
  temperature, top-k/p, min-p) get their processors at each position (history: their tokens and the candidates
  before it), then `greedy_accept` on those scores (greedy) or `speculative_sample` with one-hot draft
  distributions (the candidates are deterministic) drawn with the request's generator: lossless sampling;
- the emitted tokens are the accepted candidates, then the target's token (its correction, or the bonus token
  after the last candidate); the engine appends them one at a time under every stop rule;
- K/V written for rejected candidates is garbage past the committed length: `num_computed_tokens` is rolled back to
  the committed tokens (`Scheduler.postprocess`), so the prefix cache indexes only committed blocks and later steps
  overwrite the slots.
"""

from __future__ import annotations

import torch

from ..speculative.verify import Verdict, greedy_accept, speculative_sample
from .model_runner import StepOutput
from .proposer import Proposer, SpecDecodeStats
from .sampler import candidate_scores
from .scheduler import ScheduledSeq


class Speculation:
    """A `Proposer` and the counters of what was verified."""

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self.stats = SpecDecodeStats()

    def propose(self, speculating: list[ScheduledSeq]) -> None:
        """Fill the candidates of the scheduled sequences that have room for some (raises what the proposer
        raises)."""
        proposals = self.proposer.propose([s.seq for s in speculating], [s.num_drafts for s in speculating])
        for scheduled, proposal in zip(speculating, proposals):
            scheduled.keep_drafts(proposal)

    def verify(self, out: StepOutput, speculating: list[int]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """The tokens each speculating sampling sequence `i` of `out` emits, and the errors of those whose
        processing or draw raised (their requests fail alone)."""
        plain = [i for i in speculating if not out.sampling[i].seq.params.needs_processing]
        emitted = self._verify_greedy(out, plain)
        errors: dict[int, Exception] = {}
        for i in speculating:
            if i not in emitted:
                try:
                    emitted[i] = self._verify_processed(out, i)
                except Exception as error:  # this request's settings or generator: it fails alone
                    errors[i] = error
        return emitted, errors

    def _verify_greedy(self, out: StepOutput, members: list[int]) -> dict[int, list[int]]:
        by_width: dict[int, list[int]] = {}
        for i in members:
            by_width.setdefault(out.sampling[i].num_drafts, []).append(i)
        emitted = {}
        device = out.logits.device
        for width, group in by_width.items():
            drafts = torch.tensor([out.sampling[i].draft_token_ids for i in group], device=device)
            rows = torch.tensor([list(range(out.starts[i], out.starts[i] + width + 1)) for i in group], device=device)
            verdict = greedy_accept(drafts, out.logits[rows].argmax(dim=-1))  # targets: [group, width + 1]
            for i, tokens in zip(group, self._emitted(verdict, width)):
                emitted[i] = tokens
        return emitted

    def _verify_processed(self, out: StepOutput, i: int) -> list[int]:
        scheduled = out.sampling[i]
        seq, drafts = scheduled.seq, scheduled.draft_token_ids
        scores = candidate_scores(out.logits[out.rows(i)].cpu(), seq, drafts)  # [k + 1, vocab]
        candidates = torch.tensor([drafts])
        if seq.params.is_greedy:
            verdict = greedy_accept(candidates, scores.argmax(dim=-1)[None])
        else:
            probs = torch.softmax(scores, dim=-1)[None]
            one_hot = torch.zeros_like(probs[:, :-1]).scatter_(2, candidates[..., None], 1.0)
            verdict = speculative_sample(candidates, one_hot, probs, generator=seq.generator)
        return self._emitted(verdict, len(drafts))[0]

    def _emitted(self, verdict: Verdict, width: int) -> list[list[int]]:
        """Each row's emitted tokens, counting its round."""
        result = []
        for accepted, tokens in zip(verdict.num_accepted.tolist(), verdict.tokens.tolist()):
            self.stats.record(width, accepted)
            result.append(tokens[: accepted + 1])
        return result
