"""How many candidates a model-free round verifies: the k that maximises expected tokens per second. Plain Python.

Each round every generating row brings a draft whose tokens carry estimated probabilities (that the token and all
before it are accepted, `suffix_cache.Draft`). With k candidates per row, row r expects to gain
`1 + trust * sum(p_r[:k])` tokens and the round costs `cost(batch * (k + 1) tokens forwarded)` plain rounds. k = 0 is
a plain decode step, and it is the off-switch: where measured acceptance makes extra candidates cost more than they
gain (by a `MARGIN`: a round that merely breaks even on noisy estimates is not worth its risk), no candidate is
verified.

- `trust`: measured accepted / expected accepted, over recent rounds (sums decayed by `DECAY` per speculating round),
  with a prior of `PRIOR_WEIGHT` expected tokens at trust 1.
- `cap` on k: starts at `FIRST_CAP`, doubles (up to `max_tokens`) after a round that accepted at least half of what
  it expected, halves (down to `PROBE_TOKENS`) after one that did not, so one wrong guess costs a short round.
- probes: while switched off nothing is measured, so after `probe_interval` rounds off, one round speculates as if
  trust were 1, with at most `PROBE_TOKENS` candidates (a probe measures; it need not pay). Its outcome is evidence
  like any round's: when it pays, speculation is back on; when not, the next probe waits four times as long
  (`FIRST_PROBE_INTERVAL`, then x4 up to `MAX_PROBE_INTERVAL`): 3 probes in 128 rounds where nothing repeats.
- cost: a speculating round's seconds relative to a plain round's (`RoundCost`): the median of recent plain rounds,
  and a least squares line of speculating rounds' seconds on the tokens they forward (on CPU a forward of more than
  one token per row costs a step up: a matrix product instead of a matrix-vector one, more logits, a materialised
  causal mask). The line needs 3 rounds (before: the prior slope through their mean); its slope is never negative and
  a speculating round never counts cheaper than `1 + MIN_EXTRA_COST` (timing noise on a shared machine). Until
  measured, the prior `1 + PRIOR_JUMP + PRIOR_TOKEN_COST * extra tokens` (CPU-like). Or fixed: `token_cost`, the
  extra cost of one candidate per row relative to a plain step (0: speculate whenever a draft exists).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

DECAY, PRIOR_WEIGHT = 0.9, 1.0
FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL, PROBE_TOKENS, FIRST_CAP = 4, 128, 4, 8
PRIOR_JUMP, PRIOR_TOKEN_COST, COST_DECAY, MIN_FIT_ROUNDS, PLAIN_WINDOW = 0.3, 0.03, 0.95, 3, 16
MIN_EXTRA_COST = 0.1  # a speculating round is never counted cheaper than this over a plain one (timing noise)
MARGIN = 0.1  # speculate only where expected tokens per second beat a plain step's by this much (estimates are noisy)


@dataclass(slots=True)
class RoundCost:
    """A round's seconds relative to a plain round's (see the module docstring): plain rounds' median over the last
    `PLAIN_WINDOW` (robust to a slow round on a shared machine), and a line through speculating rounds, whose weights
    decay by `COST_DECAY` per observation."""

    plain: deque[float] = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))  # seconds of plain rounds
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # speculating rounds: weight, x, y, xx, xy
    num_speculating: int = 0

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
        w, x, y, xx, xy = self.sums
        if len(self.plain) < MIN_FIT_ROUNDS or w < 1.0:  # not measured yet
            return 1.0 + PRIOR_JUMP + PRIOR_TOKEN_COST * (tokens - base)
        plain = statistics.median(self.plain)
        spread = w * xx - x * x
        fitted = self.num_speculating >= MIN_FIT_ROUNDS and spread > 1e-9 * w * xx  # rounds of several sizes
        slope = max((w * xy - x * y) / spread, 0.0) if fitted else PRIOR_TOKEN_COST * plain
        return max((y + slope * (tokens * w - x)) / (w * plain), 1.0 + MIN_EXTRA_COST)


@dataclass(slots=True)
class DraftBudget:
    """Chooses each round's k (see the module docstring) and learns from the round's outcome.

    Args:
        max_tokens: the longest chain a round verifies.
        token_cost: fixed extra cost of one candidate per row, relative to a plain step; None: measured.
    """

    max_tokens: int = 32
    token_cost: float | None = None
    accepted: float = 0.0  # decayed sums of accepted candidates ...
    expected: float = 0.0  # ... and of their estimated probabilities
    cost: RoundCost = field(default_factory=RoundCost)
    num_rounds: int = 0  # rounds updated so far (the first one's time holds one-off costs: not measured)
    num_off_rounds: int = 0  # rounds switched off since the last speculating round
    probe_interval: int = FIRST_PROBE_INTERVAL
    cap: int = FIRST_CAP

    @property
    def trust(self) -> float:
        """Measured accepted / expected accepted candidates, with the prior."""
        return (self.accepted + PRIOR_WEIGHT) / (self.expected + PRIOR_WEIGHT)

    def choose(self, probabilities: Sequence[Sequence[float]], batch_size: int) -> int:
        """k for a round in which generating row r's draft has `probabilities[r]` (cumulative, one per token) and
        the forward runs `batch_size` rows."""
        k = self._best_k(probabilities, batch_size, self.trust)
        if k > 0:
            self.num_off_rounds, self.probe_interval = 0, FIRST_PROBE_INTERVAL
        elif any(probabilities):  # switched off
            self.num_off_rounds += 1
            if self.num_off_rounds >= self.probe_interval:
                self.num_off_rounds = 0
                self.probe_interval = min(4 * self.probe_interval, MAX_PROBE_INTERVAL)
                k = min(self._best_k(probabilities, batch_size, 1.0), PROBE_TOKENS)
        return k

    def _best_k(self, probabilities: Sequence[Sequence[float]], batch_size: int, trust: float) -> int:
        longest = min(self.max_tokens, self.cap, max((len(p) for p in probabilities), default=0))
        gains = [0.0] * (longest + 1)  # gains[k]: expected accepted candidates over rows with k per row
        for row in probabilities:
            total = 0.0
            for k in range(1, longest + 1):
                total += row[k - 1] if k <= len(row) else 0.0
                gains[k] += total
        best_k, best_rate = 0, len(probabilities) * (1.0 + MARGIN)
        for k in range(1, longest + 1):
            rate = (len(probabilities) + trust * gains[k]) / self._relative_cost(k, batch_size)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def update(self, expected: float, accepted: int, k: int, batch_size: int, seconds: float | None) -> None:
        """After a round of k candidates per row whose drafts expected `expected` accepted candidates in all and got
        `accepted`; `seconds`: the round's wall time (None: not measured)."""
        if k > 0 and expected > 0:
            self.accepted = self.accepted * DECAY + accepted
            self.expected = self.expected * DECAY + expected
            paid = 2 * accepted >= expected
            self.cap = min(2 * self.cap, self.max_tokens) if paid else max(self.cap // 2, PROBE_TOKENS)
        if seconds is not None and self.num_rounds > 0:
            self.cost.observe(batch_size * (k + 1), batch_size, seconds)
        self.num_rounds += 1

    def _relative_cost(self, k: int, batch_size: int) -> float:
        if self.token_cost is not None:
            return 1.0 + self.token_cost * k
        return self.cost.relative(batch_size * (k + 1), batch_size)
