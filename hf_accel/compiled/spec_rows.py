"""Host bookkeeping of a compiled speculative call: each row's generated tokens and when it stops. Plain Python.

A row stops at the first emitted token that is an EOS token (kept) or that fills its budget of `max_new_tokens`
(`generate`'s `max_length` minus the padded prompt width, the same for every row, as `MaxLengthCriteria` counts).
Tokens a round emits past a stop are dropped. The output is what greedy `generate` returns: the padded prompts, then
each row's tokens, rows that stopped early padded with `pad_token_id` up to the longest row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class RowTokens:
    """Generated tokens per row (`generated[r]`), the stop rules, and which rows are done."""

    max_new_tokens: int
    eos_token_ids: frozenset[int]
    generated: list[list[int]]
    finished: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.finished:
            self.finished = [False] * len(self.generated)

    @classmethod
    def empty(cls, rows: int, max_new_tokens: int, eos_token_ids: Sequence[int]) -> RowTokens:
        """`rows` rows with nothing generated yet."""
        return cls(max_new_tokens, frozenset(eos_token_ids), [[] for _ in range(rows)])

    @property
    def is_done(self) -> bool:
        return all(self.finished)

    @property
    def remaining(self) -> list[int]:
        """Tokens each row may still emit (0 for a finished row)."""
        return [0 if done else self.max_new_tokens - len(out) for done, out in zip(self.finished, self.generated)]

    def emit(self, row: int, tokens: Sequence[int]) -> int:
        """Append `tokens` to `row` up to and including a stop; returns how many were kept."""
        out, kept = self.generated[row], 0
        for token in tokens:
            if self.finished[row]:
                break
            out.append(token)
            kept += 1
            self.finished[row] = token in self.eos_token_ids or len(out) >= self.max_new_tokens
        return kept

    def sequences(self, input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
        """`[rows, prompt_width + longest output]`: the padded prompts, then each row's tokens, padded."""
        width = max(len(out) for out in self.generated)
        tail = [out + [pad_token_id] * (width - len(out)) for out in self.generated]
        return torch.cat([input_ids, input_ids.new_tensor(tail).reshape(len(tail), width)], dim=1)
