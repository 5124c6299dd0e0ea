"""How many candidates a chain drafter (draft model, EAGLE head) drafts per row next round: the k with the most
expected tokens per unit of cost, priced by the measured `RoundCost` as every "how many candidates" choice is. Plain
Python.

- gain: a round of k candidates also says what every shorter chain would have gained in it (each row's accepted prefix
  cut at the shorter length), as a Medusa tree's prefixes do (`tree_size`). A call lasts until its furthest-behind row
  ends, so a round gains what it takes off the most tokens any row has left (`tree_size.batch_progress`): at batch
  size > 1 candidates that only the rows ahead keep gain nothing. Lengthening a chain by one adds 0 or 1 to that; the
  rate at which length j adds 1 given that length j - 1 did is counted per j, shrunk toward the rate pooled over all
  lengths (`SHRINK` rounds of it; the pool's own prior `PRIOR_RATE`), so one unlucky round does not rule a length out
  and lengths never tried take the pooled rate. Expected extra tokens at k: the sum over i <= k of the product of the
  rates up to i. Every speculating round weighs earlier counts `DECAY` less; k grows at most `GROWTH` past the last
  round's.
- neighbours: every `EXPLORE_EVERY`-th round drafts one more or one fewer than the best k (by turns), so the
  cost line is fitted across the sizes the choice is between, not at one size only, and the next length's
  acceptance keeps being measured.
- cost: the `RoundCost` of the batch size over the tokens the verify forward scores (rows x (k + 1)), the first
  round of each k at each batch size left out (one-off costs: a compiled loop compiles for a new shape then). Its
  prior adds `DRAFT_COST` per candidate (one drafter forward, for the whole batch) to a model-free round's; once
  rounds of several lengths are timed, their line prices them.
- off-switch (`allow_off`: the eager loops): k = 0 is a plain decode step. Whether any k pays depends on what a plain
  round costs, and plain rounds are timed only while that is in question: while the best k's expected tokens per
  cost (priced without plain rounds) is under `CONFIDENT` times a plain round's, every `PLAIN_SPACING`-th round is
  plain until `MIN_FIT_ROUNDS` are timed, so a speculator that clearly pays never spends a round on them. Once they
  are, k = 0 wins where no k beats a plain round by `MARGIN`, and the `ProbeSchedule` says when a round speculates
  again (at most `PROBE_TOKENS`) to measure. The compiled loops keep k >= 1: a plain round there would leave the
  drafter's static pool a variable number of positions behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .draft_budget import MARGIN, PROBE_TOKENS
from .round_cost import PRIOR_TOKEN_COST, ProbeSchedule, RoundCost
from .tree_size import batch_progress

DECAY, SHRINK, PRIOR_RATE, DRAFT_COST, GROWTH, CONFIDENT, PLAIN_SPACING = 0.9, 2.0, 0.8, 0.15, 2, 1.3, 2
EXPLORE_EVERY = 6


@dataclass(slots=True)
class DraftLength:
    """Candidates per row k for the next round (see the module docstring), learned from every round's outcome.

    Args:
        num_tokens: k of the first round.
        max_tokens: the longest chain a round drafts.
        allow_off: whether k may be 0 (a plain round) by choice, not only at a call's last token.
    """

    num_tokens: int = 4
    max_tokens: int = 16
    allow_off: bool = True
    added: list[float] = field(default_factory=list)  # per length j: decayed rounds in which j added 1 (j - 1 had)
    tried: list[float] = field(default_factory=list)  # per length j: decayed rounds of k >= j in which j - 1 added 1
    costs: dict[int, RoundCost] = field(default_factory=dict)  # batch size -> what its rounds cost
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)
    last_k: int = 0  # candidates of the last speculating round
    num_rounds: int = 0
    seen: set[tuple[int, int]] = field(default_factory=set)  # (batch size, k) of the rounds run so far

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"`max_draft_tokens` must be >= 1, got {self.max_tokens}")
        if not 1 <= self.num_tokens <= self.max_tokens:
            raise ValueError(f"`num_draft_tokens` must be in 1..max_draft_tokens={self.max_tokens}, got "
                             f"{self.num_tokens}")
        self.added, self.tried = [0.0] * (self.max_tokens + 1), [0.0] * (self.max_tokens + 1)
        self.last_k = self.num_tokens

    def cost(self, batch_size: int) -> RoundCost:
        """What rounds of `batch_size` rows cost (learned from those rounds only)."""
        prior = PRIOR_TOKEN_COST + DRAFT_COST / batch_size  # per extra token forwarded: a drafter pass per k
        return self.costs.setdefault(batch_size, RoundCost(prior_token_cost=prior))

    def next(self, budget: int, batch_size: int = 1) -> int:
        """k for a round of `batch_size` rows in which no row may gain more than `budget` tokens (k + 1 at most)."""
        longest = min(self.max_tokens, budget - 1, self.last_k + GROWTH)
        if longest <= 0:
            return 0
        if self.num_rounds == 0:
            return min(self.num_tokens, longest)
        rates = self.rates(longest, batch_size)
        best = max(range(1, longest + 1), key=rates.__getitem__)
        if self.num_rounds % EXPLORE_EVERY == 0:  # a neighbour of the best, by turns above and below
            best = min(max(best + (1 if self.num_rounds // EXPLORE_EVERY % 2 else -1), 1), longest)
        if not self.allow_off:
            return best
        if not self.cost(batch_size).is_measured:  # time plain rounds only while speculation may not pay
            in_question = rates[best] < CONFIDENT
            return 0 if in_question and self.num_rounds % PLAIN_SPACING == 0 else best
        speculating = rates[best] >= 1.0 + MARGIN
        if self.probes.is_probe(speculating):
            return min(best, PROBE_TOKENS)
        return best if speculating else 0

    def rates(self, longest: int, batch_size: int) -> list[float]:
        """Expected progress per plain round's cost of k = 0 .. `longest` candidates at `batch_size` rows."""
        pooled = (sum(self.added) + PRIOR_RATE) / (sum(self.tried) + 1.0)
        cost, rates, gain, reach = self.cost(batch_size), [1.0], 0.0, 1.0
        for k in range(1, longest + 1):
            reach *= (self.added[k] + SHRINK * pooled) / (self.tried[k] + SHRINK)  # P(length k adds 1)
            gain += reach
            rates.append((1.0 + gain) / cost.relative(batch_size * (k + 1), batch_size))
        return rates

    def update(self, k: int, accepted: Sequence[int], batch_size: int = 1, seconds: float | None = None,
               remaining: Sequence[int] | None = None) -> None:
        """After a round of `batch_size` rows that drafted `k` candidates per row and took `seconds` (None: not
        timed), in which generating row r accepted `accepted[r]` and had `remaining[r]` tokens left before it (None:
        every row equally far from its end)."""
        if k > 0 and accepted:
            self.added, self.tried = [n * DECAY for n in self.added], [n * DECAY for n in self.tried]
            previous = batch_progress([0] * len(accepted), remaining)
            for length in range(1, k + 1):  # each row's accepted prefix cut at every shorter length
                progress = batch_progress([min(n, length) for n in accepted], remaining)
                self.tried[length] += 1.0
                if progress == previous:  # the chain stopped adding here: longer lengths were not reached
                    break
                self.added[length] += 1.0
                previous = progress
            self.last_k = k
        if seconds is not None and (batch_size, k) in self.seen:
            self.cost(batch_size).observe(batch_size * (k + 1), batch_size, seconds)
        self.seen.add((batch_size, k))
        self.num_rounds += 1
