"""`StructuredLogitsProcessor`: generate's next-token scores masked to what each row's grammar allows.

One xgrammar `GrammarMatcher` per row. At each call, every row's matcher first accepts the token the row chose last
(the last column of `input_ids`; none at the first call, which sees the prompt), then fills the row's bit of one
`[rows, vocab]` bitmask, which is applied to the scores in place: tokens the grammar forbids get -inf, so greedy and
sampling both choose among the allowed ones (sampling from the target's distribution renormalised over them).
A row whose grammar is complete allows only its stop tokens; a row that stopped (generate pads it from then on)
accepts nothing more. Rows are generate's rows in order, so beam search (which reorders them) is refused by the
caller.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from .matcher import TokenMatcher, apply_bitmask, token_bitmask


class StructuredLogitsProcessor(LogitsProcessor):
    """Masks generate's scores to `compiled` (an xgrammar `CompiledGrammar`), one matcher per row, created at the
    first call for as many rows as it sees."""

    def __init__(self, compiled: Any):
        self.compiled = compiled
        self.matchers: list[TokenMatcher] = []
        self.bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = input_ids.shape[0]
        if not self.matchers:
            self.matchers = [TokenMatcher(self.compiled) for _ in range(rows)]
            self.bitmask = token_bitmask(rows, self.compiled.tokenizer_info.vocab_size)
        else:
            for matcher, token in zip(self.matchers, input_ids[:, -1].tolist()):
                if not matcher.is_terminated:  # a stopped row: generate pads it whatever it draws
                    matcher.accept(token)
        for row, matcher in enumerate(self.matchers):
            matcher.fill(self.bitmask, row)
        apply_bitmask(scores, self.bitmask)
        return scores
