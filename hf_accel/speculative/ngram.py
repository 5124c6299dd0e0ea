"""Model-free speculative decoding as a `custom_generate` callable: prompt lookup plus a shared `SuffixCache`, for
any batch size and any croppable cache.

    cache = hf_accel.SuffixCache()          # shared across calls: earlier outputs become drafts
    out = model.generate(**inputs, custom_generate=hf_accel.ngram_generate, suffix_cache=cache)

Each round every row's drafter (`NgramDrafter`) drafts from n-gram matches in the row's own tokens and in the shared
cache; `DraftBudget` picks how many candidates per row to verify (0: a plain decode step, the off-switch); one target
forward scores them and `chain` keeps each row's accepted prefix, exactly as `draft_generate` does with a draft
model's tokens. At the end each row's generated tokens are added to the shared cache. Under a grammar
(`structured_output=`) a row whose grammar forces its next tokens drafts those instead (jump-forward,
`jump_forward.py`); `jump_forward_generate` is this loop with the grammar as the only drafter (a constrained
`generate` call's default).

With `compile_config=CompileConfig(...)` the target's forwards run compiled over a static paged pool, rejected
candidates rolled back in place (`compiled/ngram_loop.py`; `compiled/route.py` puts its entry in this function's
place); calls it does not cover (logits processors other than the sampling warpers, other stopping criteria,
scores) decode eagerly with a warning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.settings import check_int
from . import chain
from .chain_checks import check_call
from .decoding import Decoding, GenerateCall
from .draft_budget import DraftBudget
from .jump_forward import ForcingGrammar, jump_forward_grammar, with_forced_tokens
from .ngram_drafter import NgramDrafter, NgramSettings
from .stats import SpeculativeStats
from .suffix_cache import NO_DRAFT, Draft, SuffixCache


JUMP_FORWARD_TOKENS = 8  # forced tokens a row verifies per round at most in `jump_forward_generate`


@dataclass(slots=True)
class NgramOptions:
    """`ngram_generate`'s own arguments (see its docstring), checked: `TypeError` / `ValueError` naming the wrong one.
    After the checks `ngram_settings` None is the default `NgramSettings()`."""

    suffix_cache: SuffixCache | None
    ngram_settings: NgramSettings | None
    max_draft_tokens: int
    draft_token_cost: float | None
    ngram_stats: SpeculativeStats | None
    drafting: bool = field(default=True, init=False)  # False: a grammar's forced tokens are the only drafts

    def __post_init__(self) -> None:
        for name, kind in (("suffix_cache", SuffixCache), ("ngram_settings", NgramSettings),
                           ("ngram_stats", SpeculativeStats)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"`{name}` must be a hf_accel.{kind.__name__} or None, got {type(value).__name__}")
        check_int("max_draft_tokens", self.max_draft_tokens, 1, "a positive int")
        cost = self.draft_token_cost
        if cost is not None and (not isinstance(cost, (int, float)) or isinstance(cost, bool) or cost < 0):
            raise ValueError(f"`draft_token_cost` must be None or a number >= 0, got {cost!r}")
        self.ngram_settings = self.ngram_settings or NgramSettings()

    def budget(self) -> DraftBudget:
        """A new `DraftBudget` for one call."""
        return DraftBudget(self.max_draft_tokens, self.draft_token_cost)

    def drafters(self, rows: int) -> list[NgramDrafter | None]:
        """One new drafter per row, each reading the shared `suffix_cache` (None each when not `drafting`)."""
        if not self.drafting:
            return [None] * rows
        return [NgramDrafter(self.ngram_settings, self.suffix_cache) for _ in range(rows)]

    def add_outputs(self, outputs: list[list[int]]) -> None:
        """Add each row's generated tokens to the shared `suffix_cache` (when there is one)."""
        if self.suffix_cache is not None:
            for output in outputs:
                self.suffix_cache.add(output)


@dataclass(slots=True)
class NgramRun:
    """One `ngram_generate` call: the loop's state, the target and its cache, a drafter per row, the tokens so far
    (prompt without padding, then generated) and the prompt's length per row, the draft budget, and the call's
    grammar when it jumps forward (its forced tokens are a row's draft: `jump_forward.py`)."""

    decoding: Decoding
    target: PreTrainedModel
    cache: Cache
    drafters: list[NgramDrafter | None]
    contexts: list[list[int]]
    prompt_lengths: list[int]
    budget: DraftBudget
    grammar: ForcingGrammar | None

    def outputs(self) -> list[list[int]]:
        """Each row's generated tokens, as `generate` returns them (without padding)."""
        batch = self.decoding.batch
        counts = torch.minimum(batch.num_generated, batch.limit).tolist()
        return [context[start : start + n] for context, start, n in zip(self.contexts, self.prompt_lengths, counts)]


def ngram_generate(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                   stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                   suffix_cache: SuffixCache | None = None, ngram_settings: NgramSettings | None = None,
                   max_draft_tokens: int = 32, draft_token_cost: float | None = None,
                   ngram_stats: SpeculativeStats | None = None, tokenizer: Any = None, hf_accel_streamer: Any = None,
                   **model_kwargs: Any) -> GenerateDecoderOnlyOutput | torch.LongTensor:
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
    With `compile_config` in the generation config, greedy calls and calls sampling with the in-graph warpers run
    compiled (see the module docstring); their output's `past_key_values` is None.
    Returns what `generate` returns: `sequences` (`[batch, prompt + new]`, finished rows padded with
    `pad_token_id`), or a `GenerateDecoderOnlyOutput` with `scores` / `logits` / `past_key_values` when asked. At
    batch size > 1 the returned cache holds holes (see `RaggedBatch`) and cannot be continued from.
    """
    options = NgramOptions(suffix_cache, ngram_settings, max_draft_tokens, draft_token_cost, ngram_stats)
    call = GenerateCall(model, input_ids, logits_processor, stopping_criteria, generation_config, hf_accel_streamer,
                        model_kwargs)
    return run_ngram(call, options)


def jump_forward_generate(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                          stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                          tokenizer: Any = None, hf_accel_streamer: Any = None,
                          **model_kwargs: Any) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """A constrained `generate` call's loop (`generate(structured_output=...)` runs it where it applies; see
    `structured/generate_kwarg.py`): `ngram_generate`'s rounds with the grammar's forced tokens as the only drafts
    (`jump_forward.py`). Output equals constrained plain decoding's (greedy: token for token)."""
    options = NgramOptions(None, None, JUMP_FORWARD_TOKENS, None, None)
    options.drafting = False
    call = GenerateCall(model, input_ids, logits_processor, stopping_criteria, generation_config, hf_accel_streamer,
                        model_kwargs)
    return run_ngram(call, options)


def run_ngram(call: GenerateCall, options: NgramOptions) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """`ngram_generate`'s loop over a checked call (also `jump_forward_generate`'s, with `options.drafting` off)."""
    run = _start(call, options)
    run.decoding.run(lambda: _prefill(run), lambda _: _round(run), (call.model,))
    options.add_outputs(run.outputs())
    return run.decoding.output(call.generation_config, run.cache)


def _start(call: GenerateCall, options: NgramOptions) -> NgramRun:
    check_call(call, "ngram_generate" if options.drafting else "jump_forward_generate")
    decoding = Decoding.start(call, options.ngram_stats)
    cache = call.model_kwargs["past_key_values"]
    cache.activate_past_recording()  # sliding-window layers must keep what a crop may take back
    mask = call.model_kwargs.get("attention_mask")
    rows = call.input_ids.tolist() if mask is None else [
        [t for t, m in zip(ids, keep) if m] for ids, keep in zip(call.input_ids.tolist(), mask.tolist())]
    return NgramRun(decoding, call.model, cache, options.drafters(len(rows)), rows, [len(row) for row in rows],
                    options.budget(), jump_forward_grammar(call.logits_processor))


def _prefill(run: NgramRun) -> None:
    before = run.decoding.batch.num_generated.tolist()
    chain.prefill(run.decoding, run.target, run.cache)
    _grow_contexts(run, before)


def _round(run: NgramRun) -> None:
    """Draft per row, choose k, verify in one target forward, keep each row's accepted prefix."""
    started = time.perf_counter()
    batch = run.decoding.batch
    remaining = batch.remaining.tolist()
    drafts: list[Draft | None] = [None if left <= 0 else NO_DRAFT for left in remaining]
    if run.grammar is not None:  # forced tokens first: a row that has some drafts nothing else this round
        drafts = with_forced_tokens(drafts, run.grammar, run.contexts, run.prompt_lengths, remaining,
                                    run.budget.max_tokens)
    drafting = [drafter if draft is NO_DRAFT else None for drafter, draft in zip(run.drafters, drafts)]
    drafts = [draft if drafter is None else new for draft, drafter, new in zip(
        drafts, drafting, row_drafts(drafting, run.contexts, remaining, run.budget.max_tokens))]
    generating = [d for d in drafts if d is not None]
    counts = candidate_counts(drafts, run.budget.choose(generating, len(drafts)))
    candidates = padded_candidates(drafts, counts, batch.pad_token_id, batch.columns.device)
    k = candidates.shape[1]
    num_candidates = torch.tensor(counts, device=candidates.device)
    history = batch.with_candidates(candidates) if k else batch.tokens
    verdict, scores, logits = chain.verify(run.decoding, run.target, run.cache, candidates, history, None,
                                           num_candidates)
    before = batch.num_generated.tolist()
    accepted = verdict.num_accepted.tolist() if k else [0] * len(drafts)
    chain.keep(run.decoding, run.cache, verdict, scores, logits, k=k, record=True, num_candidates=num_candidates)
    _grow_contexts(run, before)
    run.budget.update(generating, [n for d, n in zip(drafts, accepted) if d is not None], k, len(drafts),
                      time.perf_counter() - started)


def row_drafts(drafters: list[NgramDrafter | None], contexts: list[list[int]], remaining: list[int],
               max_tokens: int) -> list[Draft | None]:
    """A draft of at most `max_tokens` per row from its drafter and its tokens so far (`contexts`); None for finished
    rows (`remaining[r]` 0; a row's last token has no room for a candidate, and a row without a drafter drafts
    nothing: an empty draft)."""
    return [None if left <= 0 else NO_DRAFT if drafter is None else drafter.draft(context, min(max_tokens, left - 1))
            for drafter, context, left in zip(drafters, contexts, remaining)]


def candidate_counts(drafts: list[Draft | None], k: int) -> list[int]:
    """Candidates each row verifies when a round verifies k per row: its draft's first (at most) k tokens."""
    return [0 if d is None else min(len(d.tokens), k) for d in drafts]


def padded_candidates(drafts: list[Draft | None], counts: list[int], pad_token_id: int,
                      device: torch.device) -> torch.Tensor:
    """`[rows, max(counts)]`: row r's first `counts[r]` draft tokens, then `pad_token_id` (never accepted: past the
    row's count)."""
    width = max(counts, default=0)
    rows = [(list(d.tokens[:n]) if n else []) + [pad_token_id] * (width - n) for d, n in zip(drafts, counts)]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(drafts), width)


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
