"""`DraftBudget`: the k that maximises expected tokens per unit of cost, its cap, trust per draft source, the
off-switch when acceptance does not pay and the probe after it, and its round costs per batch size (the model itself:
test_round_cost.py)."""

import pytest

from hf_accel.speculative.draft_budget import DraftBudget
from hf_accel.speculative.suffix_cache import Draft


def _drafts(*rows: list[float], source: str = "own") -> list[Draft]:
    return [Draft(list(range(len(p))), list(p), source=source) for p in rows]


def test_k_maximises_expected_tokens_per_cost():
    budget = DraftBudget(max_tokens=8, token_cost=0.25)
    # trust 1: k tokens cost 1 + k / 4; the draft's third token is unlikely, so k = 2 pays best: (1 + 1.8) / 1.5
    assert budget.choose(_drafts([0.9, 0.9, 0.1, 0.1]), batch_size=1) == 2
    assert DraftBudget(max_tokens=1, token_cost=0.25).choose(_drafts([0.9, 0.9]), batch_size=1) == 1
    assert DraftBudget(token_cost=0.0).choose(_drafts([0.5] * 3, [0.2] * 5), batch_size=2) == 5  # free: the longest
    assert budget.choose(_drafts([], []), batch_size=2) == 0


def test_speculation_switches_off_when_acceptance_does_not_pay_and_probes_later():
    budget = DraftBudget(max_tokens=8, token_cost=0.1)
    draft = _drafts([1.0] * 8)
    assert budget.choose(draft, 1) == 8
    rounds = 1
    while (k := budget.choose(draft, 1)) > 0:  # nothing is ever accepted
        budget.update(draft, [0], k=k, batch_size=1, seconds=None)
        rounds += 1
    assert rounds < 5 and budget.trust("own") < 0.2
    waits, probes = [], []
    for _ in range(3):  # switched off: a probe after 4 rounds, then after 16, 64 while probes keep failing
        off = 0
        while (k := budget.choose(draft, 1)) == 0:
            off += 1
        waits.append(off)
        probes.append(k)
        budget.update(draft, [0], k=k, batch_size=1, seconds=None)
    # 4 rounds off then a probe (the first was the while test above), 16, 64: the probe is the last round counted
    assert waits == [2, 15, 63] and probes == [4, 4, 4] and budget.choose(_drafts([], []), 2) == 0
    while budget.choose(draft, 1) == 0:
        pass
    for _ in range(3):  # the probe pays, and so do the rounds after it: speculation is back
        budget.update(draft, [4], k=4, batch_size=1, seconds=None)
    assert budget.choose(draft, 1) == 8 and budget.probe_interval == 4


def test_trust_is_measured_per_draft_source():
    budget = DraftBudget(max_tokens=8, token_cost=0.1)
    own, shared = _drafts([1.0] * 8), _drafts([1.0] * 8, source="shared")
    for _ in range(3):  # the shared cache's drafts keep failing, the row's own keep being accepted
        budget.update(own + shared, [8, 0], k=8, batch_size=2, seconds=None)
    assert budget.trust("own") == pytest.approx(1.0) and budget.trust("shared") < 0.1
    assert budget.choose(own, 1) == 8 and budget.choose(shared, 1) == 0


def test_the_cap_on_k_doubles_after_paying_rounds_and_halves_after_a_miss():
    budget = DraftBudget(max_tokens=32, token_cost=0.0)
    draft = _drafts([1.0] * 32)
    ks = []
    for accepted_share in (1.0, 1.0, 0.1, 0.5):
        ks.append(k := budget.choose(draft, 1))
        budget.update(draft, [int(k * accepted_share)], k=k, batch_size=1, seconds=None)
    assert ks == [8, 16, 32, 16] and budget.choose(draft, 1) == 32


def test_per_row_counts_verify_the_likeliest_candidates_of_the_whole_step():
    budget = DraftBudget(max_tokens=8, token_cost=0.25)  # a candidate costs a quarter of a plain step over 1 row
    # over 2 rows a candidate costs 1/8 of the plain step: worth it while its probability beats 1/8 of the step's
    # expected tokens per cost (3.4 after the three likeliest: 0.6 is worth it, 0.1 and 0.05 are not)
    sure, unsure = [0.95, 0.9, 0.85, 0.05], [0.6, 0.1]
    assert budget.choose_counts(_drafts(sure, unsure), batch_size=2) == [3, 1]
    assert budget.choose_counts(_drafts(unsure, sure), batch_size=2) == [1, 3]  # by probability, not by row
    assert budget.choose_counts(_drafts([], sure), batch_size=2) == [0, 3]  # a row without a draft decodes plainly
    assert DraftBudget(max_tokens=2, token_cost=0.25).choose_counts(_drafts(sure, unsure), 2) == [2, 1]  # the cap


def test_per_row_counts_switch_off_where_trust_is_low_and_probe_later():
    budget = DraftBudget(max_tokens=8, token_cost=0.1)
    draft = _drafts([1.0] * 8, [0.9] * 8)
    assert budget.choose_counts(draft, 2) == [8, 8]
    for _ in range(4):  # nothing is ever accepted
        budget.learn(draft, [8, 8], [0, 0])
    off = 0
    while (counts := budget.choose_counts(draft, 2)) == [0, 0]:
        off += 1
    assert off == 3 and max(counts) <= 4  # the fourth round off probes, with at most PROBE_TOKENS per row


def test_round_costs_are_kept_per_batch_size():
    budget = DraftBudget()
    for _ in range(3):
        budget.cost(1).observe(1, 1, 0.010)
        budget.cost(4).observe(4, 4, 0.020)
    assert budget.cost(1).plain != budget.cost(4).plain and set(budget.costs) == {1, 4}
