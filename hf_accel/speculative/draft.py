"""Draft-model speculative decoding as a `custom_generate` callable, for any batch size and any croppable cache.

    out = model.generate(**inputs, custom_generate=hf_accel.draft_generate, draft_model=draft)

Each round the draft proposes k tokens (k adapts, `DraftLength`), the target scores them in one forward, and
`verify.greedy_accept` / `verify.speculative_sample` keep a prefix per row. Rows keep their own lengths through
holes in the cache layout (`RaggedBatch`), so both caches are only ever cropped, every row alike. Logits processors
and stopping criteria see each row's compact tokens, one accepted token at a time: nothing past a stop is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import loop
from .draft_checks import check_inputs
from .draft_length import DraftLength
from .loop import Decoding, GenerateCall
from .ragged_batch import RaggedBatch
from .stats import SpeculativeStats
from .verify import Verdict, greedy_accept, speculative_sample


@dataclass(slots=True)
class DraftRun:
    """One `draft_generate` call: the loop's state, the two models and their caches, the adaptive draft length."""

    decoding: Decoding
    target: PreTrainedModel
    draft: PreTrainedModel
    target_cache: Cache
    draft_cache: Cache
    length: DraftLength
    draft_length_seen: int = 0  # columns the draft cache holds


@dataclass(slots=True)
class Proposal:
    """One round's drafts: `tokens` `[batch, k]`, the distributions they were sampled from (`probs`,
    `[batch, k, vocab]`, None for greedy or k == 0), and the compact tokens with the drafts after each row's history
    (`history`, `[batch, prompt_width + max_new_tokens + 1 + k]`)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    history: torch.Tensor


def draft_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft_model: PreTrainedModel | None = None,
    num_draft_tokens: int = 4,
    max_draft_tokens: int = 16,
    draft_stats: SpeculativeStats | None = None,
    tokenizer: Any = None,
    hf_accel_streamer: Any = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Speculative decoding with a small draft model; pass as `model.generate(..., custom_generate=draft_generate)`.

    Greedy output equals plain greedy `generate`; sampling is lossless (speculative sampling). Works at any batch
    size (left padding, rows accepting different numbers of tokens), with the cache `generate` built for the target
    (DynamicCache, `cache_implementation="paged"`, `"quantized"` with backend `"hf_accel"`, any croppable cache);
    the draft keeps its own `DynamicCache`.

    Args:
        draft_model: the draft; same tokenizer and vocabulary as `model`.
        num_draft_tokens: draft length of the first round; later rounds adapt (`DraftLength`).
        max_draft_tokens: the longest draft a round may propose.
        draft_stats: a `SpeculativeStats` to add this call's counters to (target forwards, acceptance per position).
        tokenizer: needed by `stop_strings` (generate hands it only to callables that name it).
        hf_accel_streamer: the `streamer=` of `generate` (hf_accel's registry forwards it under this name).
    Returns what `generate` returns: `sequences` (`[batch, prompt + new]`, finished rows padded with
    `pad_token_id`), or a `GenerateDecoderOnlyOutput` with `scores` / `logits` / `past_key_values` when asked. At
    batch size > 1 the returned cache holds holes (see `RaggedBatch`) and cannot be continued from.
    """
    call = GenerateCall(model, input_ids, logits_processor, stopping_criteria, generation_config, hf_accel_streamer,
                        model_kwargs)
    run = _start(call, draft_model, DraftLength(num_draft_tokens, max_draft_tokens), draft_stats)
    loop.run(run.decoding, lambda: _prefill(run), lambda _: _round(run))
    return loop.output(run.decoding, generation_config, run.target_cache)


def _start(call: GenerateCall, draft_model: PreTrainedModel | None, length: DraftLength,
           stats: SpeculativeStats | None) -> DraftRun:
    check_inputs(call, draft_model)
    decoding = loop.start(call, stats)
    cache = call.model_kwargs["past_key_values"]
    cache.activate_past_recording()  # sliding-window layers must keep what a crop may take back
    return DraftRun(decoding, call.model, draft_model, cache, DynamicCache(), length)


def _forward(model, cache, batch: RaggedBatch, ids, mask, positions, keep: int) -> torch.Tensor:
    """Raw logits `[batch, keep, vocab]` in fp32 for `ids` `[batch, n]` appended to what `cache` holds."""
    out = model(input_ids=ids, attention_mask=None if batch.is_dense else mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[:, -keep:].to(dtype=torch.float32, copy=True)


def _prefill(run: DraftRun) -> None:
    """Target forward over the prompt and its first token, exactly as plain `generate` picks it."""
    batch, rules = run.decoding.batch, run.decoding.rules
    logits = _forward(run.target, run.target_cache, batch, batch.columns, batch.mask, batch.positions, 1)[:, 0]
    scores = rules.process(batch.view(batch.tokens, batch.history_lengths), logits.clone())
    first = rules.choose(scores)
    verdict = Verdict(torch.zeros_like(first), first[:, None])
    _keep(run, verdict, scores[:, None], logits[:, None], k=0, record=False)


def _round(run: DraftRun) -> None:
    """Draft k tokens, verify them in one target forward, keep each row's accepted prefix."""
    batch, rules = run.decoding.batch, run.decoding.rules
    k = run.length.next(int(batch.remaining.max()))
    proposal = _propose(run, k)
    ids = torch.cat([batch.columns[:, -1:], proposal.tokens], dim=1)
    mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], k))], dim=1)
    positions = batch.positions[:, -1:] + torch.arange(k + 1, device=ids.device)
    logits = _forward(run.target, run.target_cache, batch, ids, mask, positions, k + 1)
    scores = torch.stack([rules.process(batch.view(proposal.history, batch.history_lengths + j), logits[:, j].clone())
                          for j in range(k + 1)], dim=1)  # [batch, k + 1, vocab]
    if rules.do_sample:
        target_probs = torch.softmax(scores, dim=-1)
        draft_probs = target_probs[:, :0] if proposal.probs is None else proposal.probs  # k == 0: no drafts
        verdict = speculative_sample(proposal.tokens, draft_probs, target_probs)
    else:
        verdict = greedy_accept(proposal.tokens, scores.argmax(dim=-1))
    fewest_accepted = int(verdict.num_accepted[batch.unfinished].min())
    _keep(run, verdict, scores, logits, k=k, record=True)
    run.length.update(k, fewest_accepted)


def _propose(run: DraftRun, k: int) -> Proposal:
    """`k` draft tokens per row, one draft forward each (the first also catches up on columns it has not seen)."""
    batch, rules = run.decoding.batch, run.decoding.rules
    candidates = batch.columns.new_full((batch.columns.shape[0], k), batch.pad_token_id)
    tokens, probs = batch.with_candidates(candidates), []
    if k == 0:
        return Proposal(candidates, None, tokens)
    start = run.draft_length_seen
    ids, mask, positions = batch.columns[:, start:], batch.mask, batch.positions[:, start:]
    for j in range(k):
        logits = _forward(run.draft, run.draft_cache, batch, ids, mask, positions, 1)[:, 0]
        scores = rules.process(batch.view(tokens, batch.history_lengths + j), logits)
        if rules.do_sample:
            probs.append(torch.softmax(scores, dim=-1))
            token = torch.multinomial(probs[-1], 1).squeeze(1)
        else:
            token = scores.argmax(dim=-1)
        candidates[:, j] = token
        tokens.scatter_(1, (batch.history_lengths + j)[:, None], token[:, None])
        ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    run.decoding.stats.num_draft_forwards += k
    run.draft_length_seen = batch.width + k - 1  # the last draft token was never forwarded
    return Proposal(candidates, torch.stack(probs, dim=1) if probs else None, tokens)


def _keep(run: DraftRun, verdict: Verdict, scores, logits, k: int, record: bool) -> None:
    """Cut each row's emitted tokens at its budget and at the first token a stopping criterion fires on, commit
    them, and crop both caches to the new layout. `scores`, `logits`: `[batch, k + 1, vocab]`."""
    decoding = run.decoding
    batch = decoding.batch
    active = batch.unfinished.clone()
    num_emitted = torch.minimum(verdict.num_emitted, batch.remaining.clamp_min(1))
    num_to_stop, fired = _stop_points(decoding, verdict.tokens, num_emitted, scores)
    if batch.pad_finished:
        num_emitted = num_to_stop
    if record:
        decoding.stats.record_round(k, verdict.num_accepted, num_emitted, active)
    decoding.rules.collect(scores, logits, active.nonzero().squeeze(1), num_emitted)
    width_before = batch.width
    most = decoding.emit(verdict.tokens, num_emitted, fired, num_to_stop)
    if record:  # the target forwarded k + 1 columns from width_before - 1; keep up to the new last column
        run.target_cache.crop(-(k - most))
    held = min(run.draft_length_seen, width_before + most)  # == new width - 1
    if run.draft_length_seen > held:
        run.draft_cache.crop(-(run.draft_length_seen - held))
        run.draft_length_seen = held


def _stop_points(decoding: Decoding, emitted: torch.Tensor, num_emitted: torch.Tensor,
                 scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the stopping criteria after each emitted token in order (rows that already stopped once are not
    checked again); a row keeps its tokens up to the first on which one fires. Returns the cut counts and which
    rows fired, both `[batch]`."""
    batch, rules = decoding.batch, decoding.rules
    fired = torch.zeros_like(batch.stopped)
    if not rules.has_stops:
        return num_emitted, fired
    for i in range(int(num_emitted[batch.unfinished].max())):
        checked = batch.unfinished & ~batch.stopped & ~fired & (num_emitted > i)
        if not bool(checked.any()):
            break
        stop = rules.fires(batch, emitted[:, : i + 1], scores[:, i], checked)
        num_emitted = torch.where(stop, i + 1, num_emitted)
        fired |= stop
    return num_emitted, fired
