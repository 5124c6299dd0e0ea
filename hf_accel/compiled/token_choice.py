"""The next-token choice of a compiled decode step: greedy, or sampling after the warpers that are pure tensor
functions of the scores (temperature, top-k, top-p, min-p), all traced into the step's graph.

The warpers are transformers' own objects from generate's prepared `logits_processor` list, called as generate would
call them, so the rule is transformers' by construction. Sampling draws with the exponential race (the argmax of
`probs / E`, `E ~ Exp(1)`: exactly a draw from `probs`, with no host synchronisation), as gpt-fast does. A list that
holds any other processor (repetition penalty, min length, bad words, a user's own) is applied outside the graph
instead (`needs_host_processors`), on the logits the compiled forward returns, with generate's `input_ids`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..runtime.host_argmax import argmax_rows

IN_GRAPH_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def needs_host_processors(processors: LogitsProcessorList, do_sample: bool) -> bool:
    """Whether `processors` holds anything the compiled step cannot apply itself (greedy: any processor at all)."""
    if not do_sample:
        return len(processors) > 0
    return not all(type(processor) in IN_GRAPH_WARPERS for processor in processors)


def host_processing(processors: LogitsProcessorList) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`processors` as one call `(input_ids, scores) -> scores`, as the list calls them: each in turn. The list's own
    call reads every processor's signature at every step (~13 us each); these are read once, here, and a list that
    holds a processor wanting more arguments is returned as it is (it raises transformers' error)."""
    if any(len(inspect.signature(processor.__call__).parameters) > 2 for processor in processors):
        return processors
    chain = tuple(processors)

    def apply(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in chain:
            scores = processor(input_ids, scores)
        return scores

    return apply


def choose_tokens(scores: torch.Tensor, warpers: tuple, do_sample: bool) -> torch.Tensor:
    """`scores` `[rows, vocab]` fp32 -> `[rows]` next tokens: argmax, or a draw after `warpers` (in order)."""
    if not do_sample:
        return argmax_rows(scores)
    return draw(scores, warpers)[0]


def draw(scores: torch.Tensor, warpers: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores` `[rows, vocab]` fp32 -> a draw `[rows]` from the distribution after `warpers` (in order), and that
    distribution `[rows, vocab]` (what a speculative draft's acceptance is judged against)."""
    for warper in warpers:
        scores = warper(None, scores)  # these warpers never read input_ids
    probs = torch.softmax(scores, dim=-1)
    race = torch.empty_like(probs).exponential_(1)
    return argmax_rows(probs / race), probs
