"""How many candidates a model-free round verifies: the k that maximises expected tokens per second. Plain Python.

Each round every generating row brings a draft whose tokens carry estimated probabilities (that the token and all before
it are accepted, `suffix_cache.Draft`). With k candidates per row, row r expects to gain `1 + trust(source_r) *
sum(p_r[:k])` tokens and the round costs `cost(batch * (k + 1) tokens forwarded)` plain rounds. k = 0 is a plain decode
step, and it is the off-switch: where measured acceptance makes extra candidates cost more than they gain (by a
`MARGIN`: a round that merely breaks even on noisy estimates is not worth its risk), no candidate is verified.

- `trust(source)`: measured accepted / expected accepted of the drafts from one source (a row's own tokens, the shared
  cache, ...: their counts are not equally reliable), over recent rounds (sums decayed by `DECAY` per round the source
  drafted in), with a prior of `PRIOR_WEIGHT` expected tokens at trust 1.
- `cap` on k: starts at `FIRST_CAP`, doubles (up to `max_tokens`) after a round that accepted at least half of what
  it expected, halves (down to `PROBE_TOKENS`) after one that did not, so one wrong guess costs a short round.
- probes: while switched off nothing is measured, so when the `round_cost.ProbeSchedule` says so (after 4 rounds off,
  then 16, 64, 128 while probes fail), one round speculates as if trust were 1, with at most `PROBE_TOKENS` candidates
  (a probe measures; it need not pay). Its outcome is evidence like any round's: when it pays, speculation is back on.
- per row (`choose_counts`, the engine's packed steps, where rows need not verify equally many): every row's
  candidates ranked by trusted probability (a row's run in order: its probabilities never rise), and the round
  verifies the best-ranked prefix of that ranking that maximises expected tokens per cost; the cap bounds each row.
- cost: what a round of that many rows costs relative to a plain round (`round_cost.RoundCost`, one per batch size,
  measured from the rounds' wall time; a prior until measured). Or fixed: `token_cost`, the extra cost of one
  candidate per row relative to a plain round (0: speculate whenever a draft exists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .round_cost import ProbeSchedule, RoundCost
from .suffix_cache import Draft

DECAY, PRIOR_WEIGHT, PROBE_TOKENS, FIRST_CAP = 0.9, 1.0, 4, 8
MARGIN = 0.1  # speculate only where expected tokens per second beat a plain round's by this much (estimates are noisy)


@dataclass(slots=True)
class DraftBudget:
    """Chooses each round's k (see the module docstring) and learns from the round's outcome.

    Args:
        max_tokens: the longest chain a round verifies.
        token_cost: fixed extra cost of one candidate per row, relative to a plain round; None: measured.
    """

    max_tokens: int = 32
    token_cost: float | None = None
    evidence: dict[str, list[float]] = field(default_factory=dict)  # source -> decayed [accepted, expected]
    costs: dict[int, RoundCost] = field(default_factory=dict)  # batch size -> what its rounds cost
    num_rounds: int = 0  # rounds updated so far (the first one's time holds one-off costs: not measured)
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)
    cap: int = FIRST_CAP

    @property
    def probe_interval(self) -> int:
        """Rounds off before the next probe."""
        return self.probes.interval

    def trust(self, source: str) -> float:
        """Measured accepted / expected accepted candidates of drafts from `source`, with the prior."""
        accepted, expected = self.evidence.get(source, (0.0, 0.0))
        return (accepted + PRIOR_WEIGHT) / (expected + PRIOR_WEIGHT)

    def cost(self, batch_size: int) -> RoundCost:
        """What rounds of `batch_size` rows cost (learned from those rounds only)."""
        return self.costs.setdefault(batch_size, RoundCost())

    def choose(self, drafts: Sequence[Draft], batch_size: int) -> int:
        """k for a round in which the generating rows bring `drafts` and the forward runs `batch_size` rows."""
        k = self._best_k(drafts, batch_size, probe=False)
        if self._probes(drafts, k > 0):
            k = min(self._best_k(drafts, batch_size, probe=True), PROBE_TOKENS)
        return k

    def choose_counts(self, drafts: Sequence[Draft], batch_size: int) -> list[int]:
        """Candidates to verify per row (0: it decodes plainly) for a packed round of `batch_size` rows (those with
        `drafts` and the others, one token each), where rows verify different counts; see the module docstring."""
        counts = self._best_counts(drafts, batch_size, probe=False)
        if self._probes(drafts, any(counts)):
            counts = [min(n, PROBE_TOKENS) for n in self._best_counts(drafts, batch_size, probe=True)]
        return counts

    def _probes(self, drafts: Sequence[Draft], speculating: bool) -> bool:
        """Count a round on or off; whether this off round is a probe."""
        if not speculating and not any(d.tokens for d in drafts):  # nothing to verify: not switched off
            return False
        return self.probes.is_probe(speculating)

    def _best_counts(self, drafts: Sequence[Draft], batch_size: int, probe: bool) -> list[int]:
        longest = min(self.max_tokens, self.cap)
        ranked = []  # (trusted probability, position in its row, row) of every candidate the cap allows
        for r, draft in enumerate(drafts):
            trust = 1.0 if probe else self.trust(draft.source)
            ranked += [(trust * p, j, r) for j, p in enumerate(draft.probabilities[: min(longest, len(draft.tokens))])]
        ranked.sort(key=lambda c: (-c[0], c[1]))  # best first; a row's in order (its probabilities never rise)
        best_size, best_rate, gain = 0, batch_size * (1.0 + MARGIN), 0.0
        for size, (trusted, _, _) in enumerate(ranked, start=1):
            gain += trusted
            rate = (batch_size + gain) / self._relative_cost(batch_size + size, batch_size)
            if rate > best_rate:
                best_size, best_rate = size, rate
        counts = [0] * len(drafts)
        for _, _, r in ranked[:best_size]:
            counts[r] += 1
        return counts

    def _best_k(self, drafts: Sequence[Draft], batch_size: int, probe: bool) -> int:
        longest = min(self.max_tokens, self.cap, max((len(d.tokens) for d in drafts), default=0))
        gains = [0.0] * (longest + 1)  # gains[k]: trusted expected accepted candidates over rows with k per row
        for draft in drafts:
            trust, total = 1.0 if probe else self.trust(draft.source), 0.0
            for k in range(1, min(longest, len(draft.tokens)) + 1):
                total += trust * draft.probabilities[k - 1]
                gains[k] += total
            for k in range(len(draft.tokens) + 1, longest + 1):
                gains[k] += total
        best_k, best_rate = 0, len(drafts) * (1.0 + MARGIN)
        for k in range(1, longest + 1):
            rate = (len(drafts) + gains[k]) / self._relative_cost(batch_size * (k + 1), batch_size)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def update(self, drafts: Sequence[Draft], accepted: Sequence[int], k: int, batch_size: int,
               seconds: float | None) -> None:
        """After a round of k candidates per row in which the generating rows' `drafts` got `accepted[r]` of their
        first k accepted; `seconds`: the round's wall time (None: not measured)."""
        self.learn(drafts, [min(k, len(d.tokens)) for d in drafts], accepted)
        if seconds is not None and self.num_rounds > 0:
            self.cost(batch_size).observe(batch_size * (k + 1), batch_size, seconds)
        self.num_rounds += 1

    def learn(self, drafts: Sequence[Draft], counts: Sequence[int], accepted: Sequence[int]) -> None:
        """Trust and cap from a round in which row r verified the first `counts[r]` tokens of `drafts[r]` and
        `accepted[r]` of them were accepted."""
        total_accepted, total_expected = 0, 0.0
        for draft, count, num in zip(drafts, counts, accepted):
            expected = sum(draft.probabilities[:count])
            if expected > 0:
                evidence = self.evidence.setdefault(draft.source, [0.0, 0.0])
                evidence[0], evidence[1] = evidence[0] * DECAY + num, evidence[1] * DECAY + expected
                total_accepted, total_expected = total_accepted + num, total_expected + expected
        if total_expected > 0:
            paid = 2 * total_accepted >= total_expected
            self.cap = min(2 * self.cap, self.max_tokens) if paid else max(self.cap // 2, PROBE_TOKENS)

    def _relative_cost(self, tokens: int, batch_size: int) -> float:
        """A round's cost over a plain one's when it forwards `tokens` tokens for `batch_size` rows."""
        if self.token_cost is not None:
            return 1.0 + self.token_cost * (tokens - batch_size) / batch_size
        return self.cost(batch_size).relative(tokens, batch_size)
