"""Model-free speculative decoding as a `custom_generate` callable: prompt lookup plus a shared `SuffixCache`, for
any batch size and any croppable cache.

    cache = hf_accel.SuffixCache()          # shared across calls: earlier outputs become drafts
    out = model.generate(**inputs, custom_generate=hf_accel.ngram_generate, suffix_cache=cache)

Each round every row's `NgramProposer` drafts from n-gram matches in the row's own tokens and in the shared cache;
`DraftBudget` picks how many candidates per row to verify (0: a plain decode step, the off-switch); one target
forward scores them and `chain` keeps each row's accepted prefix, exactly as `draft_generate` does with a draft
model's tokens. At the end each row's generated tokens are added to the shared cache.

With `compile_config=CompileConfig(...)` the target's forwards run compiled over a static paged pool, rejected
candidates rolled back in place (`compiled/ngram_loop.py`; `compiled/route.py` puts its entry in this function's
place); calls it does not cover (sampling, logits processors,
other stopping criteria, scores) decode eagerly with a warning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.settings import check_int
from . import chain, loop
from .chain_checks import check_call
from .draft_budget import DraftBudget
from .loop import Decoding, GenerateCall
from .ngram_proposer import NgramProposer, NgramSettings
from .stats import SpeculativeStats
from .ragged_batch import RaggedBatch
from .suffix_cache import Draft, SuffixCache


@dataclass(slots=True)
class NgramRun:
    """One `ngram_generate` call: the loop's state, the target and its cache, a proposer, the tokens so far (prompt
    without padding, then generated) and the prompt's length per row, the draft budget and the shared cache."""

    decoding: Decoding
    target: PreTrainedModel
    cache: Cache
    proposers: list[NgramProposer]
    contexts: list[list[int]]
    prompt_lengths: list[int]
    budget: DraftBudget
    shared: SuffixCache | None

    def outputs(self) -> list[list[int]]:
        """Each row's generated tokens, as `generate` returns them (without padding)."""
        batch = self.decoding.batch
        counts = torch.minimum(batch.num_generated, batch.limit).tolist()
        return [context[start : start + n] for context, start, n in zip(self.contexts, self.prompt_lengths, counts)]


def ngram_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    suffix_cache: SuffixCache | None = None,
    ngram_settings: NgramSettings | None = None,
    max_draft_tokens: int = 32,
    draft_token_cost: float | None = None,
    ngram_stats: SpeculativeStats | None = None,
    tokenizer: Any = None,
    hf_accel_streamer: Any = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Model-free speculative decoding; pass as `model.generate(..., custom_generate=ngram_generate)`. Greedy output
    equals plain greedy `generate`, sampling is lossless; any batch size, any croppable cache (as `draft_generate`).

    Args:
        suffix_cache: a `SuffixCache` of earlier outputs to draft from; each row's generated tokens are added to it
            at the end. None: prompt lookup only.
        ngram_settings: how drafts are matched and cut (`NgramSettings`: tree depth, `min_probability`, draft length
            per matched token).
        max_draft_tokens: the most candidates a row verifies in one round.
        draft_token_cost: extra cost of verifying one more candidate per row, relative to a plain decode step; None
            measures it from the rounds' wall time. 0 verifies every draft (for tests).
        ngram_stats: a `SpeculativeStats` to add this call's counters to.
        tokenizer: needed by `stop_strings` (generate hands it only to callables that name it).
        hf_accel_streamer: the `streamer=` of `generate` (hf_accel's registry forwards it under this name).
    With `compile_config` in the generation config, greedy calls without processors run compiled (see the module
    docstring); their output's `past_key_values` is None.
    Returns what `generate` returns: `sequences` (`[batch, prompt + new]`, finished rows padded with
    `pad_token_id`), or a `GenerateDecoderOnlyOutput` with `scores` / `logits` / `past_key_values` when asked. At
    batch size > 1 the returned cache holds holes (see `RaggedBatch`) and cannot be continued from.
    """
    call = GenerateCall(model, input_ids, logits_processor, stopping_criteria, generation_config, hf_accel_streamer,
                        model_kwargs)
    run = _start(call, suffix_cache, ngram_settings, max_draft_tokens, draft_token_cost, ngram_stats)
    loop.run(run.decoding, lambda: _prefill(run), lambda _: _round(run), (model,))
    if run.shared is not None:
        for output in run.outputs():
            run.shared.add(output)
    return loop.output(run.decoding, generation_config, run.cache)


def _start(call: GenerateCall, shared: SuffixCache | None, settings: NgramSettings | None, max_draft_tokens: int,
           token_cost: float | None, stats: SpeculativeStats | None) -> NgramRun:
    check_call(call, "ngram_generate")
    check_ngram_options(shared, settings, max_draft_tokens, token_cost, stats)
    settings = settings or NgramSettings()
    decoding = loop.start(call, stats)
    cache = call.model_kwargs["past_key_values"]
    cache.activate_past_recording()  # sliding-window layers must keep what a crop may take back
    mask = call.model_kwargs.get("attention_mask")
    rows = call.input_ids.tolist() if mask is None else [
        [t for t, m in zip(ids, keep) if m] for ids, keep in zip(call.input_ids.tolist(), mask.tolist())]
    proposers = [NgramProposer(settings, shared) for _ in rows]
    return NgramRun(decoding, call.model, cache, proposers, rows, [len(row) for row in rows],
                    DraftBudget(max_draft_tokens, token_cost), shared)


def check_ngram_options(shared: object, settings: object, max_draft_tokens: object, token_cost: object,
                   stats: object) -> None:
    for name, value, kind in (("suffix_cache", shared, SuffixCache), ("ngram_settings", settings, NgramSettings),
                              ("ngram_stats", stats, SpeculativeStats)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"`{name}` must be a hf_accel.{kind.__name__} or None, got {type(value).__name__}")
    check_int("max_draft_tokens", max_draft_tokens, 1, "a positive int")
    if token_cost is not None and (not isinstance(token_cost, (int, float)) or isinstance(token_cost, bool)
                                   or token_cost < 0):
        raise ValueError(f"`draft_token_cost` must be None or a number >= 0, got {token_cost!r}")


def _prefill(run: NgramRun) -> None:
    before = run.decoding.batch.num_generated.tolist()
    chain.prefill(run.decoding, run.target, run.cache)
    _grow_contexts(run, before)


def _round(run: NgramRun) -> None:
    """Draft per row, choose k, verify in one target forward, keep each row's accepted prefix."""
    started = time.perf_counter()
    batch = run.decoding.batch
    drafts = _drafts(run)
    generating = [d for d in drafts if d is not None]
    candidates, num_candidates = _candidates(drafts, run.budget.choose(generating, len(drafts)), batch)
    k = candidates.shape[1]
    history = batch.with_candidates(candidates) if k else batch.tokens
    verdict, scores, logits = chain.verify(run.decoding, run.target, run.cache, candidates, history, None,
                                           num_candidates)
    before = batch.num_generated.tolist()
    accepted = verdict.num_accepted.tolist() if k else [0] * len(drafts)
    chain.keep(run.decoding, run.cache, verdict, scores, logits, k=k, record=True, num_candidates=num_candidates)
    _grow_contexts(run, before)
    run.budget.update(generating, [n for d, n in zip(drafts, accepted) if d is not None], k, len(drafts),
                      time.perf_counter() - started)


def _candidates(drafts: list[Draft | None], k: int, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    # [batch, k'] each row's first (at most) k draft tokens, padded; [batch] how many are its own; k' the longest
    lengths = [0 if d is None else min(len(d.tokens), k) for d in drafts]
    k = max(lengths)
    padded = [(d.tokens[:n] if n else []) + [batch.pad_token_id] * (k - n) for d, n in zip(drafts, lengths)]
    candidates = torch.tensor(padded, dtype=torch.long, device=batch.columns.device).reshape(len(drafts), k)
    return candidates, torch.tensor(lengths, device=candidates.device)


def _drafts(run: NgramRun) -> list[Draft | None]:
    # a draft per row; None for finished rows (a row's last token has no room for one: an empty draft)
    limit, remaining = run.budget.max_tokens, run.decoding.batch.remaining.tolist()
    return [None if left <= 0 else proposer.propose(context, min(limit, left - 1))
            for proposer, context, left in zip(run.proposers, run.contexts, remaining)]


def _grow_contexts(run: NgramRun, before: list[int]) -> None:
    # append each row's newly committed tokens (compact layout) to its context
    batch = run.decoding.batch
    after = batch.num_generated.tolist()
    start, end = batch.prompt_width + min(before), batch.prompt_width + max(after)
    if end <= start:
        return
    window = batch.tokens[:, start:end].tolist()
    for context, first, last, row in zip(run.contexts, before, after, window):
        context.extend(row[first - min(before) : last - min(before)])
