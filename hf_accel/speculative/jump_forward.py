"""Jump-forward decoding in `generate`: where a constrained row's grammar allows exactly one continuation (a JSON key
after `{"`, the `": ` after it, closing brackets), those tokens are the row's draft this round, verified by the
round's target forward like any draft: each is kept only where the target's grammar-masked choice there is that
token (greedy) or accepts it (sampling), so outputs stay exactly those of constrained plain decoding (the grammar may
allow another tokenization of the forced text, which the target then picks).

`ngram_generate` drafts a row's forced tokens in place of its n-gram draft whenever the grammar forces some; a plain
`generate(structured_output=...)` call runs `jump_forward_generate` (ngram_generate's loop with the grammar as the
only drafter), chosen by `structured/generate_kwarg.py`. Forced drafts go through the same `DraftBudget` as n-gram
drafts (source "grammar", each token's probability 1): it learns their acceptance and what a wider forward costs, so
a batch whose forced tokens would not pay for the wider forward decodes plainly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .suffix_cache import Draft

SOURCE = "grammar"  # the forced drafts' source in the DraftBudget


@runtime_checkable
class ForcingGrammar(Protocol):
    """A logits processor that knows each row's grammar (`structured.logits.StructuredLogitsProcessor`)."""

    jump_forward: bool

    def forced_tokens(self, row: int, output: list[int]) -> list[int]:
        """The tokens row `row`'s grammar forces after its `output` so far (empty: the next token is a choice)."""


def jump_forward_grammar(processors: Sequence[object]) -> ForcingGrammar | None:
    """The call's structured-output processor when it jumps forward (its constraint's `jump_forward`), else None."""
    return next((p for p in processors if isinstance(p, ForcingGrammar) and p.jump_forward), None)


def with_forced_tokens(drafts: list[Draft | None], grammar: ForcingGrammar, contexts: list[list[int]],
                       prompt_lengths: list[int], remaining: list[int], max_tokens: int) -> list[Draft | None]:
    """`drafts` with each generating row's draft replaced by the tokens its grammar forces after its output so far
    (`contexts[r][prompt_lengths[r]:]`), at most `max_tokens` and one fewer than the row has left; rows whose grammar
    forces nothing keep their draft."""
    out = list(drafts)
    for row, (draft, context, start, left) in enumerate(zip(drafts, contexts, prompt_lengths, remaining)):
        if draft is None:
            continue
        forced = grammar.forced_tokens(row, context[start:])[: min(max_tokens, left - 1)]
        if forced:
            out[row] = Draft(forced, [1.0] * len(forced), source=SOURCE)
    return out
