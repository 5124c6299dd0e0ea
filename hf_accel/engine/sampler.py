"""Next tokens of one step's sequences, each with its own `SamplingParams`, through transformers' logits processors.

Rows with a grammar (`structured_outputs`) are masked first, in one bitmask for the batch. Plain greedy rows then
take one batched argmax under that mask (only the other rows' logits are written to). Other rows are grouped by their
parameters: each group runs one `LogitsProcessorList` (repetition penalty, temperature, top-k, top-p, min-p:
transformers' own classes, in the order `generate` applies them) over its rows, then draws per row with the row's
seeded generator, so a seeded request samples the same tokens whatever it is batched with. What one group's
processors or draw raise fails only that group's rows (`Sampled.errors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..runtime.host_argmax import argmax_rows
from ..structured.matcher import apply_bitmask, argmax_allowed, fill_rows, step_bitmask
from .outputs import TokenLogprob
from .sampling_params import SamplingParams
from .sequence import Sequence


def logits_processors(params: SamplingParams) -> LogitsProcessorList:
    """transformers' processors for `params`, in generate's order; empty for plain greedy."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.is_greedy:
        return processors
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        processors.append(MinPLogitsWarper(params.min_p))
    return processors


@dataclass(slots=True)
class Sampled:
    """One step's draws: `tokens[i]` for row `i`, except the rows in `errors`, whose group's processors or draw
    raised (a ValueError naming the settings, caused by what was raised: those rows' requests fail alone; their
    `tokens` entry is meaningless)."""

    tokens: list[int]
    errors: dict[int, Exception] = field(default_factory=dict)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
    """`logits` `[len(seqs), vocab]` (fp32, the caller's copy: constrained rows with processors or sampling are masked
    in place) -> one token id per sequence."""
    bitmask, masked = None, []
    if any(seq.grammar is not None for seq in seqs):  # before any processor, as vLLM applies its grammar bitmask
        bitmask, masked = fill_rows([seq.grammar for seq in seqs], logits.shape[-1])
    processed = [i for i in masked if seqs[i].params.needs_processing]
    if processed:  # their processors and draws read the masked scores; plain greedy rows need only the choice
        apply_bitmask(logits, bitmask, processed)
    result = Sampled(argmax_allowed(logits, bitmask, masked).tolist())
    groups: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        if seq.params.needs_processing:
            groups.setdefault(id(seq.params), []).append(i)
    for rows in groups.values():
        try:
            _sample_group(logits, seqs, rows, result.tokens)
        except Exception as error:  # whatever one request's settings raise fails that request only
            params = seqs[rows[0]].params
            failure = ValueError(f"sampling with this request's settings failed (`temperature`={params.temperature}, "
                                 f"`repetition_penalty`={params.repetition_penalty}, `top_p`={params.top_p}, "
                                 f"`top_k`={params.top_k}, `min_p`={params.min_p}): {type(error).__name__}: {error}")
            failure.__cause__ = error
            result.errors.update(dict.fromkeys(rows, failure))
    return result


def _sample_group(logits: torch.Tensor, seqs: list[Sequence], rows: list[int], tokens: list[int]) -> None:
    """Draw the `rows` sharing one `SamplingParams` into `tokens`."""
    params = seqs[rows[0]].params
    scores = _process(logits[rows], [seqs[i] for i in rows], params)
    if params.is_greedy:
        for i, token in zip(rows, argmax_rows(scores).tolist()):
            tokens[i] = token
        return
    probs = torch.softmax(scores, dim=-1)
    for i, row in zip(rows, probs):
        tokens[i] = int(torch.multinomial(row, 1, generator=seqs[i].generator))


def _process(logits: torch.Tensor, seqs: list[Sequence], params: SamplingParams) -> torch.Tensor:
    processors = logits_processors(params)
    if params.repetition_penalty == 1.0:  # no processor reads the history: skip building it
        return processors(None, logits)
    width = max(seq.num_tokens for seq in seqs)
    # history padded with the row's own first token, which the penalty already counts, so padding changes nothing
    history = torch.tensor([seq.token_ids + seq.token_ids[:1] * (width - seq.num_tokens) for seq in seqs],
                           device=logits.device)
    return processors(history, logits)


def candidate_scores(logits: torch.Tensor, seq: Sequence, draft_token_ids: list[int]) -> torch.Tensor:
    """`seq`'s processed scores `[k + 1, vocab]` at its last token and each of its `k` candidates: position j is
    processed (and masked by its grammar, if any) as if the first j candidates had been appended (the history a
    plain step there would see). `logits` is the caller's copy: a grammar masks it in place."""
    if seq.grammar is not None:
        bitmask = step_bitmask(len(draft_token_ids) + 1, logits.shape[-1])  # every row written by fill_drafts
        seq.grammar.fill_drafts(draft_token_ids, bitmask, 0)
        apply_bitmask(logits, bitmask)
    processors = logits_processors(seq.params)
    if seq.params.repetition_penalty == 1.0:
        return processors(None, logits)
    rows = [seq.token_ids + draft_token_ids[:j] for j in range(len(draft_token_ids) + 1)]
    width = len(rows[-1])
    history = torch.tensor([row + row[:1] * (width - len(row)) for row in rows], device=logits.device)
    return processors(history, logits)


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int | None]) -> list[TokenLogprob | None]:
    """Log-probabilities (from the raw logits) of the chosen tokens and each row's `num_top` best, where asked."""
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    result: list[TokenLogprob | None] = [None] * len(tokens)
    if not wanted:
        return result
    logprobs = torch.log_softmax(logits[wanted], dim=-1)
    for row, i in enumerate(wanted):
        top = torch.topk(logprobs[row], num_top[i]) if num_top[i] else None
        alternatives = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
        result[i] = TokenLogprob(tokens[i], float(logprobs[row, tokens[i]]), alternatives)
    return result
