"""Adaptive Medusa tree size: each round verifies the prefix of the candidate list with the most expected tokens per
unit of cost.

Candidates are ordered best first (a calibrated sparse tree is built that way), so every prefix that holds its
paths' parents is a tree of its own. A round's accepted path also says what each smaller prefix would have gained in
that round: the accepted chain cut at its first node outside the prefix. That is exact, because the walk decides
the same tokens whatever the tree (greedy, or one draw per token when sampling). A batch ends when its
furthest-behind row does, so in a batch a round gains what it takes off the most tokens any row has left
(`batch_progress`): a row that accepts candidates while another as far behind accepts none gains the batch nothing
yet (it only lets the other become the one that counts).

A round of size n forwards `batch * (1 + n)` tokens; what that costs relative to a plain round is the measured
`RoundCost` of the batch size (the cost model `DraftBudget` uses too), so the cost of verifying batch x tree-size
tokens is what is weighed. The size chosen maximises (1 + mean gain) / relative cost: on a GPU, where a forward over
many tokens costs about one over a single token, that is the whole tree; on a CPU, at larger batches, or when
sampling at high temperature accepts little, a small one or none.

Size 0 is a plain round (no candidates, the heads do not run): where nothing pays off, decoding costs what plain
decoding costs. Exploring is kept cheap, since a large tree at a large batch costs several plain rounds on a CPU: the
first round verifies the whole tree (acceptance for every size, and the cost model's first tree round: timed, unlike
`DraftBudget`'s first round, since timing it again would cost another whole tree; its cold caches only overprice trees,
and its weight decays as tree rounds run), then plain rounds until the cost model is measured. A tree smaller than every
tree that has run is priced no lower than the smallest that has (what a tree round costs over a plain round, for the
heads, the tree mask and the walk, is not measured below it), so small trees are not tried on the strength of the line's
prior slope. Afterwards the size above the best is probed whenever the extra cost it adds fits in `probe_share` of the
cost spent at the best size since the last probe, so sizes that do not pay cost at most that share, and each probe's
time refines the cost model where the choice is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .round_cost import MIN_FIT_ROUNDS, RoundCost

# candidate counts tried (those that leave a prefix-closed tree), plus the whole list
SIZE_GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def prefix_sizes(paths: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Grid sizes `n` below `len(paths)` whose first `n` paths hold each path's parent (0 included), then
    `len(paths)`."""
    closed, seen = [0], set()
    for count, path in enumerate(paths, start=1):
        seen.add(path)
        if count in SIZE_GRID and count < len(paths) and all(p[:-1] in seen for p in paths[:count] if len(p) > 1):
            closed.append(count)
    return (*closed, len(paths))


@dataclass(slots=True)
class TreeSizer:
    """Running acceptance per candidate prefix size and the measured round costs; `choose` picks the size index for
    the next round of `batch_size` rows."""

    sizes: tuple[int, ...]  # increasing candidate counts; the last is the whole list
    probe_share: float = 0.02  # most of the decoding cost spent re-trying the size above the best
    gains: list[float] = field(default_factory=list)  # per size: accepted tokens over the next smaller size, summed
    observed: list[int] = field(default_factory=list)  # per size: rounds that measured its acceptance
    costs: dict[int, RoundCost] = field(default_factory=dict)  # batch size -> what its rounds cost
    smallest_run: int | None = None  # index of the smallest tree (size > 0) that has run
    since_probe: float = 0.0  # relative cost spent at the best size since another size last ran
    num_rounds: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 0:
            raise ValueError(f"`sizes` must be increasing candidate counts >= 0, got {self.sizes}")
        if not 0 <= self.probe_share < 1:
            raise ValueError(f"`probe_share` must be in [0, 1), got {self.probe_share}")
        self.gains, self.observed = [0.0] * len(self.sizes), [0] * len(self.sizes)

    def cost(self, batch_size: int) -> RoundCost:
        """What rounds of `batch_size` rows cost (learned from those rounds only)."""
        return self.costs.setdefault(batch_size, RoundCost())

    def choose(self, batch_size: int) -> int:
        """Index into `sizes` of the prefix the next round of `batch_size` rows verifies."""
        whole = len(self.sizes) - 1
        if self.num_rounds == 0:
            return whole  # acceptance for every size
        cost = self.cost(batch_size)
        if not cost.is_measured:  # time what the cost model lacks: plain rounds, else a tree round
            return 0 if cost.num_plain < MIN_FIT_ROUNDS else whole
        costs = self.relative_costs(batch_size)  # priced once for the choice and the probe
        best = self._best(costs)
        if best == whole or 0 < best < (self.smallest_run or 0):
            return best  # priced as the smallest tree that ran: running it measures it
        return best + 1 if self.since_probe * self.probe_share >= costs[best + 1] - costs[best] else best

    def best(self, batch_size: int) -> int:
        """Index of the size with the most expected tokens per unit of cost at `batch_size` rows."""
        return self._best(self.relative_costs(batch_size))

    def mean_accepted(self, index: int) -> float:
        """Tokens beyond the root's that size `index` gains the batch per round (`batch_progress` minus 1): the sum of
        each size's mean gain over the next smaller one, each mean over every round that measured it (so the
        estimate never falls as the size grows)."""
        return self._mean_accepted_all()[index]

    def relative_costs(self, batch_size: int) -> list[float]:
        """Each size's round cost at `batch_size` rows relative to a plain round: `RoundCost.relative` of the
        `batch_size * (1 + size)` tokens it forwards, and no less, for a tree smaller than every tree that has run,
        than the smallest that has (a tree round's fixed cost over a plain round, for the heads, the tree mask and
        the walk, is not measured below it)."""
        cost = self.cost(batch_size)
        costs = [cost.relative(batch_size * (1 + size), batch_size) for size in self.sizes]
        if self.smallest_run is not None:
            for index in range(1, self.smallest_run):
                costs[index] = max(costs[index], costs[self.smallest_run])
        return costs

    def tokens_per_cost(self, index: int, batch_size: int) -> float:
        """Expected progress per plain round's cost of size `index`: the root's token plus the mean gain, over its
        relative cost."""
        return self._tokens_per_cost_all(self.relative_costs(batch_size))[index]

    def record(self, index: int, accepted_ranks: Sequence[Sequence[int]], seconds: float, batch_size: int,
               remaining: Sequence[int] | None = None) -> None:
        """A round of `batch_size` rows that verified size `index` took `seconds`; `accepted_ranks[r]`: the best-first
        ranks of the candidates row r accepted, in path order (root excluded), one entry per row still generating;
        `remaining[r]`: the tokens that row had left before the round (None: every row equally far from its end)."""
        cost = self.cost(batch_size)
        if cost.is_measured:  # cost spent at the best size since anything else (exploring, a probe) last ran
            costs = self.relative_costs(batch_size)
            self.since_probe = self.since_probe + costs[index] if index == self._best(costs) else 0.0
        previous = 1
        for smaller in range(index + 1):
            limit = self.sizes[smaller]  # each accepted chain cut at its first candidate outside the prefix
            counts = [next((i for i, rank in enumerate(ranks) if rank >= limit), len(ranks))
                      for ranks in accepted_ranks]
            progress = batch_progress(counts, remaining)
            self.gains[smaller] += progress - previous
            self.observed[smaller] += 1
            previous = progress
        cost.observe(batch_size * (1 + self.sizes[index]), batch_size, seconds)
        if self.sizes[index] > 0 and (self.smallest_run is None or index < self.smallest_run):
            self.smallest_run = index
        self.num_rounds += 1

    def _best(self, costs: list[float]) -> int:
        rates = self._tokens_per_cost_all(costs)
        return max(range(len(rates)), key=rates.__getitem__)

    def _mean_accepted_all(self) -> list[float]:
        running, means = 0.0, []
        for gain, observed in zip(self.gains, self.observed):
            running += gain / observed if observed else 0.0
            means.append(running)
        return means

    def _tokens_per_cost_all(self, costs: list[float]) -> list[float]:
        return [(1.0 + accepted) / cost for accepted, cost in zip(self._mean_accepted_all(), costs)]


def batch_progress(accepted: Sequence[int], remaining: Sequence[int] | None = None) -> int:
    """How far a round brings the batch's end closer: by how much the most tokens any row has left falls when row r
    emits its root token and `accepted[r]` candidates (at most `remaining[r]` in all). The call lasts until its
    furthest-behind row ends, so that, not the mean over rows, is what a round's candidates gain the batch. With
    `remaining` None every row is equally far behind: the least any row emits."""
    if not accepted:
        return 1
    if remaining is None:
        return 1 + min(accepted)
    return max(remaining) - max(left - min(1 + count, left) for count, left in zip(accepted, remaining))
