"""A step's commit, in one place: the tokens each sequence the step sampled for emits, appended under the stop rules.

For every sequence whose last token the step computed (`StepOutput.sampling`):
- a plain one draws its next token (`sampler.sample`: one batched argmax for plain greedy, its processors and seeded
  generator otherwise);
- a speculating one (its last token and `k` candidates in one packed row; `k` may differ per row) keeps what the
  target's logits at those `1 + k` positions decide, exactly what plain decoding gives (`speculative.verify`):
  plain-greedy rows take `greedy_accept` on the logits' argmax, batched by candidate count; rows with a grammar
  (`structured_outputs`, masked at each position by what it allows there) or logits processors (penalties, temperature,
  top-k/p, min-p) get their processors at each position (history: their tokens and the candidates before it,
  `sampler.candidate_scores`; greedy rows whose grammar is all their processing are masked together, one bitmask over
  all their positions and one masked argmax: `_verify_grammar_greedy`), then `greedy_accept` on those scores (greedy) or
  `speculative_sample` with one-hot draft distributions (the candidates are deterministic) drawn with the request's
  generator: lossless sampling. It emits its accepted candidates, then the target's token (its correction, or the bonus
  token after the last candidate); each round is counted (`SpecDecodeStats`);
- the emitted tokens are appended one at a time, with their logprobs (from the raw logits) where asked, and
  `check_stop` after each: the first stop ends the sequence and drops the tokens after it;
- K/V written for rejected candidates is garbage past the committed length: `num_computed_tokens` moves on by the
  candidates kept only (`Scheduler.postprocess`), so the prefix cache indexes committed blocks alone and later steps
  overwrite the slots.

Faults: what one request's sampling settings, verification, logprobs, detokenization or stop rules raise fails that
request alone (`fail`, at once: none of its samples commits after), and the others commit as if it were not there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..runtime.host_argmax import argmax_rows
from ..speculative.verify import Verdict, greedy_accept, speculative_sample
from .model_runner import StepOutput
from .outputs import TokenLogprob
from ..structured.matcher import argmax_allowed, step_bitmask
from .sampler import candidate_scores, sample, token_logprobs
from .sequence import Request, Sequence
from .spec_decode.spec_decode_stats import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class Finish:
    """Why a sequence stops: `reason` "stop" or "length", and `stop_reason` (the stop string or stop token id that
    ended it; None for EOS and length)."""

    reason: str
    stop_reason: str | int | None = None


def check_stop(seq: Sequence, stop_string: str | None, eos_token_ids: set[int], max_model_len: int) -> Finish | None:
    """Whether `seq` stops after its last token (`stop_string`: the stop string its text just completed, if any), by
    the first rule that holds: that stop string, a stop token id, EOS (unless `ignore_eos`), its grammar complete
    (`structured_outputs`: a stop token accepted), `max_tokens` or `max_model_len` reached; None while it goes on."""
    token, params = seq.token_ids[-1], seq.params
    if stop_string is not None:
        return Finish("stop", stop_string)
    if token in params.stop_token_ids:
        return Finish("stop", token)
    if token in eos_token_ids and not params.ignore_eos:
        return Finish("stop")
    if seq.grammar is not None and seq.grammar.is_terminated:  # its constraint is complete: even with ignore_eos
        return Finish("stop")
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return Finish("length")
    return None


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """The ids that end a sequence: the model's generation config's `eos_token_id`, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _needs_scores(seq: Sequence) -> bool:
    """Whether verifying `seq`'s candidates needs its processed (or grammar-masked) scores, not the raw argmax."""
    return seq.params.needs_processing or seq.grammar is not None


def _grammar_only(seq: Sequence) -> bool:
    """Whether `seq` is greedy with a grammar and no other processing (`Committer._verify_grammar_greedy`)."""
    return seq.grammar is not None and seq.params.is_greedy and not seq.params.needs_processing


class Committer:
    """Commits steps' tokens to their sequences (see the module docstring); `fail(request, error)` ends a request
    alone. Counts the tokens generated and the rounds verified (`spec_decode`)."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int, fail: Callable[[Request, BaseException], None]):
        self.eos_token_ids, self.max_model_len, self.fail = eos_token_ids, max_model_len, fail
        self.spec_decode = SpecDecodeStats()
        self.generation_tokens = 0

    def commit(self, out: StepOutput, now: float) -> dict[int, int]:
        """Append each sampling sequence's new tokens (sampled, or verified candidates); returns the candidates each
        committed sequence kept, by `seq_id` (0 for a plain one)."""
        emitted = self._verify(out)
        self._sample_plain(out, emitted)
        num_accepted = {}
        for i, scheduled in enumerate(out.sampling):
            if scheduled.seq.is_finished:  # its request failed earlier in this step
                continue
            try:
                num_accepted[scheduled.seq.seq_id] = self._commit_one(out, i, emitted[i], now)
            except Exception as error:
                self.fail(scheduled.seq.request, error)
        return num_accepted

    def _sample_plain(self, out: StepOutput, emitted: dict[int, list[int]]) -> None:
        """Draw the next token of each sampling sequence without candidates into `emitted`."""
        plain = [i for i, s in enumerate(out.sampling) if not s.num_drafts]
        if not plain:
            return
        sampled = sample(out.logits[[out.starts[i] for i in plain]], [out.sampling[i].seq for i in plain])
        for row, i in enumerate(plain):
            if row in sampled.errors:  # its sampling settings could not be applied to these logits
                self.fail(out.sampling[i].seq.request, sampled.errors[row])
            else:
                emitted[i] = [sampled.tokens[row]]

    def _verify(self, out: StepOutput) -> dict[int, list[int]]:
        """The tokens each speculating sampling sequence `i` emits; those whose processing or draw raised fail."""
        speculating = [i for i, s in enumerate(out.sampling) if s.num_drafts]
        if not speculating:
            return {}
        emitted = self._verify_greedy(out, [i for i in speculating if not _needs_scores(out.sampling[i].seq)])
        emitted.update(self._verify_grammar_greedy(out, [i for i in speculating if _grammar_only(out.sampling[i].seq)]))
        for i in speculating:
            if i not in emitted and not out.sampling[i].seq.is_finished:  # (finished: failed in this step)
                try:
                    emitted[i] = self._verify_processed(out, i)
                except Exception as error:  # this request's settings or generator: it fails alone
                    self.fail(out.sampling[i].seq.request, error)
        return emitted

    def _verify_greedy(self, out: StepOutput, members: list[int]) -> dict[int, list[int]]:
        by_width: dict[int, list[int]] = {}
        for i in members:
            by_width.setdefault(out.sampling[i].num_drafts, []).append(i)
        emitted = {}
        device = out.logits.device
        for width, group in by_width.items():
            drafts = torch.tensor([out.sampling[i].draft_token_ids for i in group], device=device)
            rows = torch.tensor([list(range(out.starts[i], out.starts[i] + width + 1)) for i in group], device=device)
            verdict = greedy_accept(drafts, argmax_rows(out.logits[rows]))  # targets: [group, width + 1]
            for i, tokens in zip(group, self._emitted(verdict, width)):
                emitted[i] = tokens
        return emitted

    def _verify_grammar_greedy(self, out: StepOutput, members: list[int]) -> dict[int, list[int]]:
        """`_verify_processed` for greedy sequences whose grammar is their only processing, all at once: one bitmask
        over every member's `1 + k` positions (each filled as after the candidates before it), one masked argmax for
        them all, then each one's candidates kept while they equal its masked argmax."""
        if not members:
            return {}
        rows = [row for i in members for row in range(out.starts[i], out.starts[i] + out.sampling[i].num_drafts + 1)]
        bitmask = step_bitmask(len(rows), out.logits.shape[-1])  # every row written: `fill_drafts` fills or allows all
        filled, first = [], 0
        for i in members:
            scheduled = out.sampling[i]
            try:
                scheduled.seq.grammar.fill_drafts(scheduled.draft_token_ids, bitmask, first)
                filled.append((i, first))
            except Exception as error:  # this request's grammar: it fails alone (its rows are not read)
                self.fail(scheduled.seq.request, error)
            first += scheduled.num_drafts + 1
        targets = argmax_allowed(out.logits[rows], bitmask, list(range(len(rows)))).tolist()
        emitted = {}
        for i, first in filled:
            drafts = out.sampling[i].draft_token_ids
            kept = 0
            while kept < len(drafts) and drafts[kept] == targets[first + kept]:
                kept += 1
            self.spec_decode.record(len(drafts), kept)
            emitted[i] = [*drafts[:kept], targets[first + kept]]
        return emitted

    def _verify_processed(self, out: StepOutput, i: int) -> list[int]:
        scheduled = out.sampling[i]
        seq, drafts = scheduled.seq, scheduled.draft_token_ids
        scores = candidate_scores(out.logits[out.rows(i)].to("cpu", copy=True), seq, drafts)  # [k + 1, vocab]
        candidates = torch.tensor([drafts])
        if seq.params.is_greedy:
            verdict = greedy_accept(candidates, argmax_rows(scores)[None])
        else:
            probs = torch.softmax(scores, dim=-1)[None]
            one_hot = torch.zeros_like(probs[:, :-1]).scatter_(2, candidates[..., None], 1.0)
            verdict = speculative_sample(candidates, one_hot, probs, generator=seq.generator)
        return self._emitted(verdict, len(drafts))[0]

    def _emitted(self, verdict: Verdict, width: int) -> list[list[int]]:
        """Each row's emitted tokens, counting its round."""
        result = []
        for accepted, tokens in zip(verdict.num_accepted.tolist(), verdict.tokens.tolist()):
            self.spec_decode.record(width, accepted)
            result.append(tokens[: accepted + 1])
        return result

    def _commit_one(self, out: StepOutput, i: int, tokens: list[int], now: float) -> int:
        """Sampling sequence `i`'s part of `commit`: append `tokens` (its draw, or its verified candidates and the
        target's token) under the stop rules. Returns the candidates it kept."""
        seq = out.sampling[i].seq
        logprobs = token_logprobs(out.logits[out.rows(i)][: len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
        num_appended = self._append_all(seq, tokens, logprobs, now)
        return min(len(tokens) - 1, num_appended)  # K/V is valid for the last token and the kept candidates

    def _append_all(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None], now: float) -> int:
        """Append `tokens` one at a time until a stop rule ends the sequence; returns how many were appended."""
        for n, (token, logprob) in enumerate(zip(tokens, logprobs), start=1):
            self._append(seq, token, logprob, now)
            if seq.is_finished:
                return n
        return len(tokens)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float) -> None:
        timing = seq.request.timing
        if timing.first_token is None:
            timing.first_token = now
        timing.last_token = now
        self.generation_tokens += 1
        stop_string = seq.append_token(token, logprob, now)
        finish = check_stop(seq, stop_string, self.eos_token_ids, self.max_model_len)
        if finish is not None:
            seq.finish(finish.reason, finish.stop_reason)
