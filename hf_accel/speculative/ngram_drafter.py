"""The model-free drafter of one sequence: n-gram matches in its own tokens (prompt lookup) and in a `SuffixCache`
shared across calls and requests. Plain Python, no torch; `ngram_generate` keeps one `NgramDrafter` per row, the
engine one per sequence.

    drafter = NgramDrafter(NgramSettings(), shared=cache)
    draft = drafter.draft(context_token_ids, max_tokens=8)   # draft.tokens, draft.probabilities

Both sources are suffix trees with counts (`SuffixCache`): the sequence's own (its prompt and output so far, grown
as the context grows) and the shared one (earlier outputs). Each offers its best draft for the context's tail; the
one with more expected accepted tokens wins (SuffixDecoding's rule), the sequence's own on ties; its `source` says
which ("own" or "shared").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..cache.settings import check_int
from .suffix_cache import NO_DRAFT, Draft, SuffixCache


@dataclass(frozen=True, slots=True)
class NgramSettings:
    """How drafts are matched and cut.

    max_depth: longest n-gram the sequence's own suffix tree counts (and longest match; drafts go on past it along
        the most recent occurrence).
    min_probability: a draft stops before a token whose estimated probability (that it and every token before it
        are right, from the counts) is below this.
    tokens_per_match: a match of m tokens drafts at most `tokens_per_match * m + extra_tokens` tokens.
    extra_tokens: see `tokens_per_match`.
    """

    max_depth: int = 24
    min_probability: float = 0.1
    tokens_per_match: float = 2.0
    extra_tokens: float = 2.0

    def __post_init__(self) -> None:
        check_int("max_depth", self.max_depth, 2, "an int >= 2")
        for name in ("min_probability", "tokens_per_match", "extra_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"`{name}` must be a number, got {value!r} ({type(value).__name__})")
        if not 0.0 <= self.min_probability <= 1.0:
            raise ValueError(f"`min_probability` must be in [0, 1], got {self.min_probability}")
        if self.tokens_per_match < 0 or self.extra_tokens < 0:
            raise ValueError(f"`tokens_per_match` and `extra_tokens` must be >= 0, got {self.tokens_per_match}, "
                             f"{self.extra_tokens}")


class NgramDrafter:
    """Drafts for one growing sequence (see the module docstring).

    Args:
        settings: matching and cut-off rules.
        shared: a `SuffixCache` of earlier outputs to draft from too (read only here; the caller adds outputs).
    """

    def __init__(self, settings: NgramSettings, shared: SuffixCache | None = None):
        self.settings, self.shared = settings, shared
        self._own = SuffixCache(settings.max_depth)
        self._seq = self._own.add(())
        self._num_seen = 0

    @property
    def num_seen(self) -> int:
        """Context tokens indexed so far."""
        return self._num_seen

    def draft(self, context_token_ids: Sequence[int], max_tokens: int) -> Draft:
        """The best draft of at most `max_tokens` tokens to follow `context_token_ids` (the sequence's tokens so far:
        each call's context extends the previous one's)."""
        assert len(context_token_ids) >= self._num_seen, "a sequence's context only grows"
        self._own.extend(self._seq, context_token_ids[self._num_seen :])
        self._num_seen = len(context_token_ids)
        if max_tokens <= 0 or not context_token_ids:
            return NO_DRAFT
        rules = self.settings
        cut = (max_tokens, rules.min_probability, rules.tokens_per_match, rules.extra_tokens)
        own = self._own.speculate(context_token_ids, *cut, continuing=self._seq)
        shared = NO_DRAFT if self.shared is None else self.shared.speculate(context_token_ids, *cut)
        return replace(shared, source="shared") if shared.score > own.score else replace(own, source="own")
