"""Adaptive Medusa tree size: each step verifies the prefix of the candidate list that gives the most tokens per second.

Candidates are ordered best first (a calibrated sparse tree is built that way), so every prefix that holds its
paths' parents is a tree of its own. A step's accepted path also says what each smaller prefix would have gained at
that step: the accepted chain cut at its first node outside the prefix. That is exact, because the walk decides
the same tokens whatever the tree (greedy, or one draw per token when sampling). A batch ends when its furthest-behind
row does, so in a batch a step gains what it takes off the most tokens any row has left (`batch_progress`): a row
that accepts candidates while another as far behind accepts none gains the batch nothing yet (it only lets the
other become the one that counts). Each size's seconds per step are measured when it runs, for the whole batch,
so the cost of verifying batch x tree-size tokens is what is weighed. The size chosen maximises (1 + mean gain) /
seconds per step: on a GPU, where a forward over many tokens costs about one over a single token, that is the
whole tree; on a CPU, at larger batches, or when sampling at high temperature accepts little, a small one or none.

Size 0 is a plain decoding step (no candidates, the heads do not run): where nothing pays off, decoding costs what
plain decoding costs. Exploring is kept cheap, since a large tree at a large batch costs several plain steps on a
CPU: the first step verifies the whole tree (measuring acceptance for every size; its time, paid with cold caches,
stands only until the whole tree runs again), the second is a plain step. A size not yet timed is priced by linear
interpolation between the timed tree sizes around it, or, while no smaller tree is timed, at the larger one's time
(a tree step has a fixed cost over a plain step that nothing measured yet bounds from below), and runs when that
price makes it the best (which times it). Afterwards the size above the best is probed again whenever the time it
costs over the best fits in `probe_share` of the decoding time since the last probe, so sizes that do not pay cost
at most that share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# candidate counts tried (those that leave a prefix-closed tree), plus the whole list
SIZE_GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SECONDS_EMA = 0.25  # weight of a new timing in a size's running seconds per step


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
    """Running acceptance and timing per candidate prefix size; `choose` picks the size index for the next step."""

    sizes: tuple[int, ...]  # increasing candidate counts; the last is the whole list
    probe_share: float = 0.02  # most of the decoding time spent re-trying the size above the best
    gains: list[float] = field(default_factory=list)  # per size: accepted tokens over the next smaller size, summed
    observed: list[int] = field(default_factory=list)  # per size: steps that measured its acceptance
    seconds: list[float | None] = field(default_factory=list)  # per size: running seconds per step (None: untimed)
    provisional: list[bool] = field(default_factory=list)  # per size: timed only by a call's first step
    since_probe: float = 0.0  # seconds decoded at the best size since another size last ran
    num_steps: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 0:
            raise ValueError(f"`sizes` must be increasing candidate counts >= 0, got {self.sizes}")
        if not 0 <= self.probe_share < 1:
            raise ValueError(f"`probe_share` must be in [0, 1), got {self.probe_share}")
        count = len(self.sizes)
        self.gains, self.observed, self.seconds = [0.0] * count, [0] * count, [None] * count
        self.provisional = [False] * count

    def choose(self) -> int:
        """Index into `sizes` of the prefix to verify next."""
        whole = len(self.sizes) - 1
        if self.seconds[whole] is None:
            return whole
        if self.seconds[0] is None:
            return 0
        seconds = self._step_seconds_all()  # priced once for the choice and the probe
        best = self._best(seconds)
        if self.seconds[best] is None or best == whole:
            return best  # priced by interpolation: running it times it
        extra = seconds[best + 1] - seconds[best]
        return best + 1 if self.since_probe * self.probe_share >= extra else best

    def best(self) -> int:
        """Index of the size with the most expected tokens per second (needs size 0 and the whole list timed)."""
        return self._best(self._step_seconds_all())

    def _best(self, seconds: list[float]) -> int:
        rates = self._tokens_per_second_all(seconds)
        return max(range(len(rates)), key=rates.__getitem__)

    def mean_accepted(self, index: int) -> float:
        """Tokens beyond the root's that size `index` gains the batch per step (`batch_progress` minus 1): the sum of
        each size's mean gain over the next smaller one, each mean over every step that measured it (so the estimate
        never falls as the size grows)."""
        return self._mean_accepted_all()[index]

    def step_seconds(self, index: int) -> float:
        """Seconds per step of size `index`: its running time, or interpolated linearly in the candidate count
        between the nearest timed sizes (those of the nearest larger one while no tree smaller is timed), raised to
        any smaller size's (more never costs less)."""
        return self._step_seconds_all()[index]

    def tokens_per_second(self, index: int) -> float:
        """Expected progress per second of size `index`: the root's token plus the mean gain, over its time."""
        return self._tokens_per_second_all(self._step_seconds_all())[index]

    def _mean_accepted_all(self) -> list[float]:
        running, means = 0.0, []
        for gain, observed in zip(self.gains, self.observed):
            running += gain / observed if observed else 0.0
            means.append(running)
        return means

    def _step_seconds_all(self) -> list[float]:
        # an untimed size is priced from its nearest timed sizes; then a running max (more never costs less)
        timed = [i for i, seconds in enumerate(self.seconds) if seconds is not None]
        running, out = 0.0, []
        for index, seconds in enumerate(self.seconds):
            if seconds is None:
                below = max(i for i in timed if i < index)
                above = min(i for i in timed if i > index)
                # below a plain step's time there is no tree step's fixed cost (heads, mask, a deeper walk) to
                # interpolate from: price at the larger timed size, an upper bound
                share = (self.sizes[index] - self.sizes[below]) / (self.sizes[above] - self.sizes[below]) if below else 1
                seconds = self.seconds[below] + share * (self.seconds[above] - self.seconds[below])
            running = max(running, seconds)
            out.append(running)
        return out

    def _tokens_per_second_all(self, step_seconds: list[float]) -> list[float]:
        return [(1.0 + accepted) / max(seconds, 1e-9)
                for accepted, seconds in zip(self._mean_accepted_all(), step_seconds)]

    def record(self, index: int, accepted_ranks: Sequence[Sequence[int]], seconds: float,
               remaining: Sequence[int] | None = None) -> None:
        """A step that verified size `index` took `seconds`; `accepted_ranks[r]`: the best-first ranks of the
        candidates row r accepted, in path order (root excluded), one entry per row still generating; `remaining[r]`:
        the tokens that row had left before the step (None: every row equally far from its end)."""
        ready = self.seconds[0] is not None and self.seconds[-1] is not None
        # time spent on the best size since anything else (exploring, a probe) last ran
        self.since_probe = self.since_probe + seconds if ready and index == self.best() else 0.0
        previous = 1
        for smaller in range(index + 1):
            limit = self.sizes[smaller]  # each accepted chain cut at its first candidate outside the prefix
            counts = [next((i for i, rank in enumerate(ranks) if rank >= limit), len(ranks)) for ranks in accepted_ranks]
            progress = batch_progress(counts, remaining)
            self.gains[smaller] += progress - previous
            self.observed[smaller] += 1
            previous = progress
        timed = self.seconds[index]
        if timed is None or self.provisional[index]:  # a call's first step pays for cold caches: stands until rerun
            self.seconds[index] = seconds
        else:
            self.seconds[index] = timed + SECONDS_EMA * (seconds - timed)
        self.provisional[index] = self.num_steps == 0
        self.num_steps += 1


def batch_progress(accepted: Sequence[int], remaining: Sequence[int] | None = None) -> int:
    """How far a step brings the batch's end closer: by how much the most tokens any row has left falls when row r
    emits its root token and `accepted[r]` candidates (at most `remaining[r]` in all). The call lasts until its
    furthest-behind row ends, so that, not the mean over rows, is what a step's candidates gain the batch. With
    `remaining` None every row is equally far behind: the least any row emits."""
    if not accepted:
        return 1
    if remaining is None:
        return 1 + min(accepted)
    return max(remaining) - max(left - min(1 + count, left) for count, left in zip(accepted, remaining))
