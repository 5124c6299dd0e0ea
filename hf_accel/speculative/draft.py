"""Draft-model speculative decoding as a `custom_generate` callable, for any batch size and any croppable cache.

    out = model.generate(**inputs, custom_generate=hf_accel.draft_generate, draft_model=draft)

Each round the drafter (a small draft model) drafts k candidates per row (k adapts, `DraftLength`), the target scores
them in one forward, and `verify.greedy_accept` / `verify.speculative_sample` keep a prefix per row. Rows keep their
own lengths through holes in the cache layout (`RaggedBatch`), so both caches are only ever cropped, every row alike.
Logits processors and stopping criteria see each row's compact tokens, one accepted token at a time: nothing past a
stop is kept.

With `compile_config=CompileConfig(...)` the draft's and the target's forwards run compiled over static paged pools,
rejected tokens rolled back in place (`compiled/draft_loop.py`; `compiled/route.py` puts its entry in this
function's place), greedy or sampled with transformers' temperature / top-k / top-p / min-p warpers; calls it does
not cover (other logits processors, other stopping criteria, scores) come back here, with a warning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..runtime.host_argmax import argmax_rows
from . import chain
from .chain_checks import check_draft_model
from .decoding import Decoding, GenerateCall
from .draft_length import DraftLength
from .stats import SpeculativeStats


@dataclass(slots=True)
class DraftOptions:
    """`draft_generate`'s own arguments (see its docstring), checked (`ValueError` naming the wrong one), with the
    call's `DraftLength`."""

    draft_model: PreTrainedModel | None
    num_draft_tokens: int
    max_draft_tokens: int
    draft_stats: SpeculativeStats | None
    length: DraftLength = field(init=False)

    def __post_init__(self) -> None:
        self.length = DraftLength(self.num_draft_tokens, self.max_draft_tokens)
        if self.draft_model is None:
            raise ValueError("draft_generate needs `draft_model=` (a small causal LM with the same tokenizer)")


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
class RoundCandidates:
    """One round's candidates: `tokens` `[batch, k]`, the distributions they were sampled from (`probs`,
    `[batch, k, vocab]`, None for greedy or k == 0), and the compact tokens with the candidates after each row's
    history (`history`, `[batch, prompt_width + max_new_tokens + 1 + k]`)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    history: torch.Tensor


def draft_generate(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                   stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                   draft_model: PreTrainedModel | None = None, num_draft_tokens: int = 4, max_draft_tokens: int = 16,
                   draft_stats: SpeculativeStats | None = None, tokenizer: Any = None, hf_accel_streamer: Any = None,
                   **model_kwargs: Any) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Speculative decoding with a small draft model; pass as `model.generate(..., custom_generate=draft_generate)`.

    Greedy output equals plain greedy `generate`; sampling is lossless (speculative sampling). Works at any batch
    size (left padding, rows accepting different numbers of tokens), with the cache `generate` built for the target
    (DynamicCache, `cache_implementation="paged"`, `"quantized"` with backend `"hf_accel"`, any croppable cache);
    the draft keeps its own `DynamicCache`.

    Args:
        draft_model: the draft; same tokenizer and vocabulary as `model`.
        num_draft_tokens: candidates per row of the first round; later rounds adapt (`DraftLength`).
        max_draft_tokens: the most candidates a round may draft per row.
        draft_stats: a `SpeculativeStats` to add this call's counters to (target forwards, acceptance per position).
        tokenizer: needed by `stop_strings` (generate hands it only to callables that name it).
        hf_accel_streamer: the `streamer=` of `generate` (hf_accel's registry forwards it under this name).
    With `compile_config` in the generation config, greedy calls and sampled ones whose processors are the in-graph
    warpers run compiled (see the module docstring); their output's `past_key_values` is None.
    Returns what `generate` returns: `sequences` (`[batch, prompt + new]`, finished rows padded with
    `pad_token_id`), or a `GenerateDecoderOnlyOutput` with `scores` / `logits` / `past_key_values` when asked. At
    batch size > 1 the returned cache holds holes (see `RaggedBatch`) and cannot be continued from.
    """
    options = DraftOptions(draft_model, num_draft_tokens, max_draft_tokens, draft_stats)
    call = GenerateCall(model, input_ids, logits_processor, stopping_criteria, generation_config, hf_accel_streamer,
                        model_kwargs)
    run = _start(call, options)
    run.decoding.run(lambda: chain.prefill(run.decoding, run.target, run.target_cache), lambda _: _round(run),
                     (run.target, run.draft))
    return run.decoding.output(generation_config, run.target_cache)


def _start(call: GenerateCall, options: DraftOptions) -> DraftRun:
    check_draft_model(call, options.draft_model)
    decoding = Decoding.start(call, options.draft_stats)
    cache = call.model_kwargs["past_key_values"]
    cache.activate_past_recording()  # sliding-window layers must keep what a crop may take back
    return DraftRun(decoding, call.model, options.draft_model, cache, DynamicCache(), options.length)


def _round(run: DraftRun) -> None:
    """Draft k candidates per row, verify them in one target forward, keep each row's accepted prefix."""
    started, batch = time.perf_counter(), run.decoding.batch
    rows, remaining = batch.columns.shape[0], batch.remaining[batch.unfinished].tolist()
    k = run.length.next(max(remaining), rows)
    drafted = _draft(run, k)
    verdict, scores, logits = chain.verify(run.decoding, run.target, run.target_cache, drafted.tokens,
                                           drafted.history, drafted.probs)
    accepted = verdict.num_accepted[batch.unfinished].tolist()
    width_before = batch.width
    most = chain.keep(run.decoding, run.target_cache, verdict, scores, logits, k=k, record=True)
    held = min(run.draft_length_seen, width_before + most)  # == new width - 1
    if run.draft_length_seen > held:
        run.draft_cache.crop(-(run.draft_length_seen - held))
        run.draft_length_seen = held
    run.length.update(k, accepted, rows, time.perf_counter() - started, remaining)


def _draft(run: DraftRun, k: int) -> RoundCandidates:
    """`k` candidates per row, one draft forward each (the first also catches up on columns it has not seen)."""
    batch, rules = run.decoding.batch, run.decoding.rules
    candidates = batch.columns.new_full((batch.columns.shape[0], k), batch.pad_token_id)
    tokens, probs = batch.with_candidates(candidates), []
    if k == 0:
        return RoundCandidates(candidates, None, tokens)
    start = run.draft_length_seen
    ids, mask, positions = batch.columns[:, start:], batch.mask, batch.positions[:, start:]
    for j in range(k):
        logits = chain.forward(run.draft, run.draft_cache, batch, ids, mask, positions, 1)[:, 0]
        scores = rules.process(batch.view(tokens, batch.history_lengths + j), logits, batch.history_lengths + j)
        if rules.do_sample:
            probs.append(torch.softmax(scores, dim=-1))
            token = torch.multinomial(probs[-1], 1).squeeze(1)
        else:
            token = argmax_rows(scores)
        candidates[:, j] = token
        tokens.scatter_(1, (batch.history_lengths + j)[:, None], token[:, None])
        ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    run.decoding.stats.num_draft_forwards += k
    run.draft_length_seen = batch.width + k - 1  # the last candidate was never forwarded
    return RoundCandidates(candidates, torch.stack(probs, dim=1) if probs else None, tokens)
