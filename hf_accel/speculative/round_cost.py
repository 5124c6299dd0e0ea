"""What a speculative round costs, measured: the one cost model behind every "how many candidates" choice
(`DraftBudget` for model-free drafts, `TreeSizer` for Medusa trees, `DraftLength` for drafter chains), and the probe
schedule of the controllers that can switch speculation off. Plain Python.

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
  `1 + PRIOR_JUMP + prior_token_cost * extra tokens` (CPU-like; `prior_token_cost` is `PRIOR_TOKEN_COST` for drafts
  that cost nothing to make, more where a drafter model runs per candidate), except that once the speculating rounds
  have a line of their own (`MIN_FIT_ROUNDS` of more than one size) it prices them, anchored to the prior at the
  line's mean: a controller that times no plain round still compares its round sizes by what they measured.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PRIOR_JUMP, PRIOR_TOKEN_COST, COST_DECAY, MIN_FIT_ROUNDS, PLAIN_WINDOW = 0.3, 0.03, 0.95, 3, 16
MIN_EXTRA_COST = 0.2  # a speculating round is never counted cheaper than this over a plain one (timing noise)
FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 4, 128


@dataclass(slots=True)
class RoundCost:
    """A round's seconds relative to a plain round's, for one batch size (see the module docstring)."""

    prior_token_cost: float = PRIOR_TOKEN_COST  # the prior's extra cost of one more token forwarded, over a plain round
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
        line = self._line()
        if not self.is_measured:
            if line is None:
                return self._prior(tokens, base)
            mean_x, mean_y, slope = line  # the measured line, anchored to the prior at its mean
            return self._prior(mean_x, base) * (mean_y + slope * (tokens - mean_x)) / mean_y
        w, x, y, _, _ = self.sums
        plain = statistics.median(self.plain)
        mean_x, mean_y, slope = line if line is not None else (x / w, y / w, self.prior_token_cost * plain)
        return max((mean_y + slope * (tokens - mean_x)) / plain, 1.0 + MIN_EXTRA_COST)

    def _prior(self, tokens: float, base: int) -> float:
        return 1.0 + PRIOR_JUMP + self.prior_token_cost * (tokens - base)

    def _line(self) -> tuple[float, float, float] | None:
        """(mean tokens, mean seconds, slope >= 0) of the speculating rounds' weighted least squares line; None until
        `MIN_FIT_ROUNDS` of them, of more than one size, are timed."""
        w, x, y, xx, xy = self.sums
        spread = w * xx - x * x
        if self.num_speculating < MIN_FIT_ROUNDS or spread <= 1e-9 * w * xx:
            return None
        return x / w, y / w, max((w * xy - x * y) / spread, 0.0)


@dataclass(slots=True)
class ProbeSchedule:
    """When a controller that switched speculation off speculates once more, to measure: while off nothing is
    measured, so after `interval` rounds off one round probes. A probe that does not bring speculation back makes the
    next wait four times as long (`FIRST_PROBE_INTERVAL`, then x4 up to `MAX_PROBE_INTERVAL`: 3 probes in 128 rounds
    where nothing pays); a round that speculates on its own merits resets the wait."""

    num_off_rounds: int = 0  # rounds off since the last speculating round
    interval: int = FIRST_PROBE_INTERVAL

    def is_probe(self, speculating: bool) -> bool:
        """Count a round on (`speculating`) or off; whether this off round is to probe instead."""
        if speculating:
            self.num_off_rounds, self.interval = 0, FIRST_PROBE_INTERVAL
            return False
        self.num_off_rounds += 1
        if self.num_off_rounds < self.interval:
            return False
        self.num_off_rounds = 0
        self.interval = min(4 * self.interval, MAX_PROBE_INTERVAL)
        return True
