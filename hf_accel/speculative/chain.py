"""One chain of candidates per row, verified by one target forward: the rounds `draft_generate`, `eagle_generate`
and `ngram_generate` share (their drafters only make the chain).

A round appends the row's newest token and its `k` candidates to the target's cache in one forward, scores the
`k + 1` positions with the call's logits processors, keeps each row's accepted prefix (`verify.greedy_accept` /
`verify.speculative_sample`), cuts it at the row's budget and at the first token a stopping criterion fires on,
commits it (`RaggedBatch.commit`) and crops the target's cache to the new layout. Rows may draft fewer than `k`
candidates (`num_candidates`): positions past a row's own are never accepted.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..runtime.host_argmax import argmax_rows
from .decoding import Decoding
from .ragged_batch import RaggedBatch
from .verify import Verdict, greedy_accept, speculative_sample


def forward(model: PreTrainedModel, cache: Cache, batch: RaggedBatch, ids: torch.Tensor, mask: torch.Tensor,
            positions: torch.Tensor, keep: int) -> torch.Tensor:
    """Raw logits `[batch, keep, vocab]` in fp32 for `ids` `[batch, n]` appended to what `cache` holds."""
    out = model(input_ids=ids, attention_mask=None if batch.is_dense else mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[:, -keep:].to(dtype=torch.float32, copy=True)


def prefill(decoding: Decoding, model: PreTrainedModel, cache: Cache) -> None:
    """Target forward over the prompt and its first token, exactly as plain `generate` picks it."""
    batch = decoding.batch
    first_token(decoding, cache, forward(model, cache, batch, batch.columns, batch.mask, batch.positions, 1)[:, 0])


def first_token(decoding: Decoding, cache: Cache, logits: torch.Tensor) -> None:
    """Decide and commit each row's first token from the prompt forward's last raw `logits` `[batch, vocab]`."""
    batch, rules = decoding.batch, decoding.rules
    scores = rules.process(batch.view(batch.tokens, batch.history_lengths), logits.clone(), batch.history_lengths)
    first = rules.choose(scores)
    verdict = Verdict(torch.zeros_like(first), first[:, None])
    keep(decoding, cache, verdict, scores[:, None], logits[:, None], k=0, record=False)


def verify(decoding: Decoding, model: PreTrainedModel, cache: Cache, candidates: torch.Tensor,
           history: torch.Tensor, draft_probs: torch.Tensor | None,
           num_candidates: torch.Tensor | None = None) -> tuple[Verdict, torch.Tensor, torch.Tensor]:
    """Score `candidates` `[batch, k]` in one target forward and accept a prefix per row.

    `history`: the compact tokens with the candidates after each row's history (`RaggedBatch.with_candidates`).
    `draft_probs`: `[batch, k, vocab]` the distributions the candidates were drawn from, when sampling; None:
    the candidates are deterministic (a one-hot distribution each). `num_candidates`: `[batch]` candidates each
    row drafted (None: all `k`). Returns the verdict and the processed scores and raw logits of
    the `k + 1` positions, `[batch, k + 1, vocab]`.
    """
    ids, mask, positions = verify_inputs(decoding.batch, candidates)
    logits = forward(model, cache, decoding.batch, ids, mask, positions, candidates.shape[1] + 1)
    return decide(decoding, logits, candidates, history, draft_probs, num_candidates)


def verify_inputs(batch: RaggedBatch, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a verification forward of `candidates` `[batch, k]` reads: ids (the newest token, then the
    candidates) and positions, both `[batch, k + 1]`, and the attention mask over every cache slot."""
    k = candidates.shape[1]
    ids = torch.cat([batch.columns[:, -1:], candidates], dim=1) if k else batch.columns[:, -1:]
    mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], k))], dim=1) if k else batch.mask
    return ids, mask, batch.positions[:, -1:] + torch.arange(k + 1, device=ids.device)


def decide(decoding: Decoding, logits: torch.Tensor, candidates: torch.Tensor, history: torch.Tensor,
           draft_probs: torch.Tensor | None,
           num_candidates: torch.Tensor | None = None) -> tuple[Verdict, torch.Tensor, torch.Tensor]:
    """`verify` after its forward: raw fp32 `logits` `[batch, k + 1, vocab]` of the verified positions."""
    batch, rules = decoding.batch, decoding.rules
    k = candidates.shape[1]
    grammar = rules.grammar_only() if k else None  # it may mask every position at once
    scores = None if grammar is None else logits.clone()
    if scores is None or not grammar.mask_candidates(batch.view(history, batch.history_lengths),
                                                     batch.history_lengths, candidates, num_candidates, scores):
        lengths = [batch.history_lengths + j for j in range(k + 1)]
        scores = torch.stack([rules.process(batch.view(history, lengths[j]), logits[:, j].clone(), lengths[j])
                              for j in range(k + 1)], dim=1)  # [batch, k + 1, vocab]
    if k == 0:  # a plain round
        chosen = rules.choose(scores[:, 0])
        return Verdict(torch.zeros_like(chosen), chosen[:, None]), scores, logits
    if rules.do_sample:
        target_probs = torch.softmax(scores, dim=-1)
        if draft_probs is None:
            draft_probs = _one_hot(candidates, num_candidates, target_probs)
        return speculative_sample(candidates, draft_probs, target_probs, num_drafts=num_candidates), scores, logits
    return greedy_accept(candidates, argmax_rows(scores), num_drafts=num_candidates), scores, logits


def _one_hot(candidates: torch.Tensor, num_candidates: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # [batch, k, vocab]: 1 at each candidate, rows past a row's own candidates all zero
    probs = like.new_zeros((*candidates.shape, like.shape[-1])).scatter_(2, candidates[..., None], 1.0)
    if num_candidates is not None:
        probs *= (torch.arange(candidates.shape[1], device=probs.device) < num_candidates[:, None])[..., None]
    return probs


def keep(decoding: Decoding, cache: Cache, verdict: Verdict, scores: torch.Tensor, logits: torch.Tensor, k: int,
         record: bool, num_candidates: torch.Tensor | None = None) -> int:
    """Cut each row's emitted tokens at its budget and at the first token a stopping criterion fires on, commit
    them, and crop `cache` to the new layout (when `record`: after a verification forward of `k` candidates).
    `scores`, `logits`: `[batch, k + 1, vocab]`. Returns M, the most tokens a row kept minus one."""
    batch = decoding.batch
    active = batch.unfinished.clone()
    num_emitted = torch.minimum(verdict.num_emitted, batch.remaining.clamp_min(1))
    num_to_stop, fired = stop_points(decoding, verdict.tokens, num_emitted, scores)
    if batch.pad_finished:
        num_emitted = num_to_stop
    if record:
        decoding.stats.record_round(k, verdict.num_accepted, num_emitted, active, row_depths=num_candidates)
    if decoding.rules.scores is not None or decoding.rules.logits is not None:
        decoding.rules.collect(scores, logits, active.nonzero().squeeze(1), num_emitted)
    most = decoding.emit(verdict.tokens, num_emitted, fired, num_to_stop)
    if record:  # the target forwarded k + 1 columns from the old last column; keep up to the new last column
        cache.crop(-(k - most))
    return most


def stop_points(decoding: Decoding, emitted: torch.Tensor, num_emitted: torch.Tensor,
                scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the stopping criteria after each emitted token in order (rows that already stopped once are not
    checked again); a row keeps its tokens up to the first on which one fires. Returns the cut counts and which
    rows fired, both `[batch]`."""
    batch, rules = decoding.batch, decoding.rules
    fired = torch.zeros_like(batch.stopped)
    if not rules.has_stops:
        return num_emitted, fired
    if not len(rules.criteria):  # EOS only: every emitted token at once
        steps = torch.arange(emitted.shape[1], device=emitted.device)
        is_eos = torch.isin(emitted, rules.eos_token_ids) & (steps < num_emitted[:, None])
        fired = is_eos.any(dim=1) & batch.unfinished & ~batch.stopped
        first = torch.where(is_eos, steps, emitted.shape[1]).min(dim=1).values
        return torch.where(fired, first + 1, num_emitted), fired
    for i in range(int(num_emitted[batch.unfinished].max())):
        checked = batch.unfinished & ~batch.stopped & ~fired & (num_emitted > i)
        if not bool(checked.any()):
            break
        stop = rules.fires(batch, emitted[:, : i + 1], scores[:, i], checked)
        num_emitted = torch.where(stop, i + 1, num_emitted)
        fired |= stop
    return num_emitted, fired
