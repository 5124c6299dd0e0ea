"""The next-token choice of a compiled decode step: greedy, or sampling after the warpers that are pure tensor
functions of the scores (temperature, top-k, top-p, min-p), all traced into the step's graph.

The warpers are transformers' own objects from generate's prepared `logits_processor` list, called as generate would
call them, so the rule is transformers' by construction. Sampling draws with the exponential race (the argmax of
`probs / E`, `E ~ Exp(1)`: exactly a draw from `probs`, with no host synchronisation), as gpt-fast does. A list that
holds any other processor (repetition penalty, min length, bad words, a user's own) is applied outside the graph
instead (`needs_host_processors`), on the logits the compiled forward returns, with generate's `input_ids`.

A grammar (`structured_output=`) alone in a greedy call's list on the CPU (without `output_scores` / `output_logits`) is
split (`graph_grammar`; `decode_loop.Decode`): the host advances each row's matcher and fills the allowed tokens'
bitmask before the step, and the step masks its logits with it and takes the argmax in the graph (`masked`). Between
steps the host then does the grammar's own work only: applying the mask and choosing there cost ~65 us a token on the
reference target (profiled, a 98-token call: 21 ms over the same call unconstrained, now 9 ms).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

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


def graph_grammar(processors: LogitsProcessorList, do_sample: bool) -> Any:
    """The grammar processor whose mask the compiled step can apply (see the module docstring): a greedy call's only
    processor, when it offers `allowed(input_ids) -> bitmask` (hf_accel's `StructuredLogitsProcessor`); else None."""
    if do_sample or len(processors) != 1:
        return None
    return processors[0] if callable(getattr(processors[0], "allowed", None)) else None


def masked(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`scores` `[rows, vocab]` with -inf where `bitmask` `[rows, words]` int32 has a 0 bit (bit `t % 32` of word
    `t // 32`: token t forbidden), as xgrammar lays it out; logits past `32 * words` are left alone (as the host
    kernel leaves them)."""
    rows, vocab = scores.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(rows, -1)
    if bits.shape[-1] < vocab:
        bits = torch.cat([bits, bits.new_ones(rows, vocab - bits.shape[-1])], dim=-1)
    return scores.masked_fill(bits[:, :vocab] == 0, float("-inf"))


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


def choose_tokens(scores: torch.Tensor, warpers: tuple, do_sample: bool,
                  bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """`scores` `[rows, vocab]` fp32 -> `[rows]` next tokens: argmax, or a draw after `warpers` (in order); only
    among the tokens `bitmask` allows (`masked`), when given."""
    if bitmask is not None:
        scores = masked(scores, bitmask)
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
