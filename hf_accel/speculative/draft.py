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

from .draft_checks import check_inputs
from .draft_length import DraftLength
from .ragged_batch import RaggedBatch, batch_for_generate, stack_steps
from .stats import SpeculativeStats
from .verify import Verdict, greedy_accept, speculative_sample

@dataclass(slots=True)
class DraftRun:
    """Everything one `draft_generate` call works on; `scores` / `logits` collect per row when requested."""

    target: PreTrainedModel
    draft: PreTrainedModel
    target_cache: Cache
    draft_cache: Cache
    batch: RaggedBatch
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList  # without MaxLengthCriteria (the batch counts each row's new tokens) and EOS
    eos_token_ids: torch.Tensor | None  # EosTokenCriteria's ids, checked on all emitted tokens at once
    do_sample: bool
    length: DraftLength
    stats: SpeculativeStats
    streamer: Any = None
    scores: list[list[torch.Tensor]] | None = None  # [row][step] processed scores [vocab]
    logits: list[list[torch.Tensor]] | None = None  # [row][step] raw logits [vocab]
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
    run = _start(model, input_ids, logits_processor, stopping_criteria, generation_config, draft_model,
                 DraftLength(num_draft_tokens, max_draft_tokens), draft_stats, hf_accel_streamer, model_kwargs)
    _prefill(run)
    while bool(run.batch.unfinished.any()):
        _round(run)
    if run.streamer is not None:
        run.streamer.end()
    return _output(run, generation_config)


def _start(model, input_ids, processors, criteria, config, draft_model, length, stats, streamer, model_kwargs):
    cache = model_kwargs.get("past_key_values")
    check_inputs(model, draft_model, config, input_ids, cache, streamer, model_kwargs)
    batch, eos, criteria = batch_for_generate(input_ids, model_kwargs.get("attention_mask"), config, criteria)
    cache.activate_past_recording()  # sliding-window layers must keep what a crop may take back
    rows = input_ids.shape[0]
    record = config.return_dict_in_generate
    scores = [[] for _ in range(rows)] if record and config.output_scores else None
    logits = [[] for _ in range(rows)] if record and config.output_logits else None
    if streamer is not None:
        streamer.put(input_ids.cpu())
    return DraftRun(model, draft_model, cache, DynamicCache(), batch, processors, criteria, eos,
                    bool(config.do_sample), length, stats if stats is not None else SpeculativeStats(), streamer,
                    scores, logits)


def _forward(model, cache, batch: RaggedBatch, ids, mask, positions, keep: int) -> torch.Tensor:
    """Raw logits `[batch, keep, vocab]` in fp32 for `ids` `[batch, n]` appended to what `cache` holds."""
    out = model(input_ids=ids, attention_mask=None if batch.is_dense else mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[:, -keep:].to(dtype=torch.float32, copy=True)


def _process(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    # LogitsProcessorList.__call__ without its per-call signature inspection (generate passes no extra kwargs)
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


def _prefill(run: DraftRun) -> None:
    """Target forward over the prompt and its first token, exactly as plain `generate` picks it."""
    batch = run.batch
    logits = _forward(run.target, run.target_cache, batch, batch.columns, batch.mask, batch.positions, 1)[:, 0]
    scores = _process(run.processors, batch.view(batch.tokens, batch.history_lengths), logits.clone())
    if run.do_sample:
        first = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
    else:
        first = scores.argmax(dim=-1)
    verdict = Verdict(torch.zeros_like(first), first[:, None])
    _keep(run, verdict, scores[:, None], logits[:, None], k=0, record=False)


def _round(run: DraftRun) -> None:
    """Draft k tokens, verify them in one target forward, keep each row's accepted prefix."""
    batch = run.batch
    k = run.length.next(int(batch.remaining.max()))
    proposal = _propose(run, k)
    ids = torch.cat([batch.columns[:, -1:], proposal.tokens], dim=1)
    mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], k))], dim=1)
    positions = batch.positions[:, -1:] + torch.arange(k + 1, device=ids.device)
    logits = _forward(run.target, run.target_cache, batch, ids, mask, positions, k + 1)
    scores = torch.stack([_process(run.processors, batch.view(proposal.history, batch.history_lengths + j),
                                   logits[:, j].clone()) for j in range(k + 1)], dim=1)  # [batch, k + 1, vocab]
    if run.do_sample:
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
    batch = run.batch
    candidates = batch.columns.new_full((batch.columns.shape[0], k), batch.pad_token_id)
    tokens, probs = batch.with_candidates(candidates), []
    if k == 0:
        return Proposal(candidates, None, tokens)
    start = run.draft_length_seen
    ids, mask, positions = batch.columns[:, start:], batch.mask, batch.positions[:, start:]
    for j in range(k):
        logits = _forward(run.draft, run.draft_cache, batch, ids, mask, positions, 1)[:, 0]
        scores = _process(run.processors, batch.view(tokens, batch.history_lengths + j), logits)
        if run.do_sample:
            probs.append(torch.softmax(scores, dim=-1))
            token = torch.multinomial(probs[-1], 1).squeeze(1)
        else:
            token = scores.argmax(dim=-1)
        candidates[:, j] = token
        tokens.scatter_(1, (batch.history_lengths + j)[:, None], token[:, None])
        ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    run.stats.num_draft_forwards += k
    run.draft_length_seen = batch.width + k - 1  # the last draft token was never forwarded
    return Proposal(candidates, torch.stack(probs, dim=1) if probs else None, tokens)


def _keep(run: DraftRun, verdict: Verdict, scores, logits, k: int, record: bool) -> None:
    """Cut each row's emitted tokens at its budget and at the first token a stopping criterion fires on, commit
    them, and crop both caches to the new layout. `scores`, `logits`: `[batch, k + 1, vocab]`."""
    batch = run.batch
    active = batch.unfinished.clone()
    num_emitted = torch.minimum(verdict.num_emitted, batch.remaining.clamp_min(1))
    num_to_stop, fired = _stop_points(run, verdict.tokens, num_emitted, scores)
    if batch.pad_finished:
        num_emitted = num_to_stop
    if record:
        run.stats.record_round(k, verdict.num_accepted, num_emitted, active)
    _collect(run, scores, logits, num_emitted, active)
    if run.streamer is not None:
        run.streamer.put(verdict.tokens[0, : int(num_to_stop[0])].cpu())
    width_before = batch.width
    most = batch.commit(verdict.tokens, num_emitted, fired, num_to_stop)
    if record:  # the target forwarded k + 1 columns from width_before - 1; keep up to the new last column
        run.target_cache.crop(-(k - most))
    held = min(run.draft_length_seen, width_before + most)  # == new width - 1
    if run.draft_length_seen > held:
        run.draft_cache.crop(-(run.draft_length_seen - held))
        run.draft_length_seen = held


def _stop_points(run: DraftRun, emitted, num_emitted, scores) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the stopping criteria after each emitted token in order (rows that already stopped once are not
    checked again); a row keeps its tokens up to the first on which one fires. Returns the cut counts and which
    rows fired, both `[batch]`. EOS is found for all tokens at once; other criteria are called token by token."""
    batch = run.batch
    fired = torch.zeros_like(batch.stopped)
    if run.eos_token_ids is not None:
        steps = torch.arange(emitted.shape[1], device=emitted.device)
        is_eos = torch.isin(emitted, run.eos_token_ids) & (steps < num_emitted[:, None])
        is_eos &= (batch.unfinished & ~batch.stopped)[:, None]
        fired = is_eos.any(dim=1)
        num_emitted = torch.where(fired, is_eos.to(torch.long).argmax(dim=1) + 1, num_emitted)
    if len(run.criteria) == 0:
        return num_emitted, fired
    tokens, cut = batch.with_candidates(emitted), torch.zeros_like(fired)
    for i in range(int(num_emitted[batch.unfinished].max())):
        reached = batch.unfinished & ~batch.stopped & ~cut & (num_emitted > i)  # EOS rows: up to their EOS
        if not bool(reached.any()):
            break
        stop = run.criteria(batch.view(tokens, batch.history_lengths + i + 1), scores[:, i]) & reached
        num_emitted = torch.where(stop, i + 1, num_emitted)
        cut |= stop
    return num_emitted, fired | cut


def _collect(run: DraftRun, scores, logits, num_emitted, active) -> None:
    for store, values in ((run.scores, scores), (run.logits, logits)):
        if store is None:
            continue
        for row in active.nonzero().squeeze(1).tolist():
            store[row].extend(values[row, : int(num_emitted[row])])


def _output(run: DraftRun, config: GenerationConfig) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    batch = run.batch
    run.stats.num_new_tokens += int(torch.minimum(batch.num_generated, batch.limit).sum())
    num_steps = batch.num_output_tokens
    sequences = batch.tokens[:, : batch.prompt_width + num_steps]
    if not config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=stack_steps(run.scores, num_steps),
                                     logits=stack_steps(run.logits, num_steps), past_key_values=run.target_cache)

