"""What a speculative round costs, measured: the one cost model behind every "how many candidates" choice
(`DraftBudget` for model-free drafts, `TreeSizer` for Medusa trees). Plain Python.

A round is one draft + verify: one target forward over `tokens` tokens, `base` of them the rows' newest tokens (one
per row: a round with no candidate is a plain decode step). Its cost is given relative to a plain round's, so
expected tokens per second compare across round sizes without absolute times. One `RoundCost` per batch size: a
round of 4 rows is a different round from one of 1.

- plain rounds: the median of the last `PLAIN_WINDOW` (robust to a slow round on a shared machine);
- speculating rounds: a least squares line of their seconds on the tokens they forward, each observation's weight
  decaying by `COST_DECAY` per later one (on CPU a forward of more than one token per row costs a step up: a matrix
  product instead of a matrix-vector one, more logits, a materialised causal mask). The line needs
  `MIN_FIT_ROUNDS` rounds of more than one size (before: the prior slope through their mean); its slope is never
  negative, and a speculating round never counts cheaper than `1 + MIN_EXTRA_COST` plain rounds (timing noise);
- until `MIN_FIT_ROUNDS` plain rounds and one speculating round are timed (`is_measured`), the prior
  `1 + PRIOR_JUMP + PRIOR_TOKEN_COST * extra tokens` (CPU-like).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PRIOR_JUMP, PRIOR_TOKEN_COST, COST_DECAY, MIN_FIT_ROUNDS, PLAIN_WINDOW = 0.3, 0.03, 0.95, 3, 16
MIN_EXTRA_COST = 0.2  # a speculating round is never counted cheaper than this over a plain one (timing noise)


@dataclass(slots=True)
class RoundCost:
    """A round's seconds relative to a plain round's, for one batch size (see the module docstring)."""

    plain: deque[float] = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))  # seconds of plain rounds
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # speculating rounds: weight, x, y, xx, xy
    num_speculating: int = 0

    @property
    def num_plain(self) -> int:
        """Plain rounds timed (the last `PLAIN_WINDOW` are kept)."""
        return len(self.plain)

    @property
    def is_measured(self) -> bool:
        """Enough rounds timed to price from them; until then `relative` gives the prior."""
        return len(self.plain) >= MIN_FIT_ROUNDS and self.sums[0] >= 1.0

    def observe(self, tokens: int, base: int, seconds: float) -> None:
        """A round that forwarded `tokens` tokens (`base`: one per row, a plain round) in `seconds`."""
        if tokens == base:
            self.plain.append(seconds)
            return
        for i, value in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            self.sums[i] = self.sums[i] * COST_DECAY + value
        self.num_speculating += 1

    def relative(self, tokens: int, base: int) -> float:
        """Cost of a round forwarding `tokens` tokens over a plain round's (`base` tokens)."""
        if tokens == base:
            return 1.0
        if not self.is_measured:
            return 1.0 + PRIOR_JUMP + PRIOR_TOKEN_COST * (tokens - base)
        w, x, y, xx, xy = self.sums
        plain = statistics.median(self.plain)
        spread = w * xx - x * x
        fitted = self.num_speculating >= MIN_FIT_ROUNDS and spread > 1e-9 * w * xx  # rounds of several sizes
        slope = max((w * xy - x * y) / spread, 0.0) if fitted else PRIOR_TOKEN_COST * plain
        return max((y + slope * (tokens * w - x)) / (w * plain), 1.0 + MIN_EXTRA_COST)
