"""`DraftBudget`: the k that maximises expected tokens per unit of cost, the off-switch when acceptance does not pay
and the probe after it, and the measured cost of a round."""

import pytest

from hf_accel.speculative.draft_budget import DraftBudget, RoundCost


def test_k_maximises_expected_tokens_per_cost():
    budget = DraftBudget(max_tokens=8, token_cost=0.25)
    # trust 1: k tokens cost 1 + k / 4; the draft's third token is unlikely, so k = 2 pays best: (1 + 1.8) / 1.5
    assert budget.choose([[0.9, 0.9, 0.1, 0.1]], batch_size=1) == 2
    assert DraftBudget(max_tokens=1, token_cost=0.25).choose([[0.9, 0.9]], batch_size=1) == 1
    assert DraftBudget(token_cost=0.0).choose([[0.5] * 3, [0.2] * 5], batch_size=2) == 5  # free: the longest
    assert budget.choose([[], []], batch_size=2) == 0


def test_speculation_switches_off_when_acceptance_does_not_pay_and_probes_later():
    budget = DraftBudget(max_tokens=8, token_cost=0.1)
    draft = [[1.0] * 8]
    assert budget.choose(draft, 1) == 8
    rounds = 1
    while budget.choose(draft, 1) > 0:  # nothing is ever accepted
        budget.update(expected=8.0, accepted=0, k=8, batch_size=1, seconds=None)
        rounds += 1
    assert rounds < 5 and budget.trust < 0.1
    waits, probes = [], []
    for _ in range(3):  # switched off: a probe after 4 rounds, then after 8, 16 while probes keep failing
        off = 0
        while (k := budget.choose(draft, 1)) == 0:
            off += 1
        waits.append(off)
        probes.append(k)
        budget.update(expected=4.0, accepted=0, k=k, batch_size=1, seconds=None)
    # 4 rounds off then a probe (the first was the while test above), 8, 16: the probe is the last round counted
    assert waits == [2, 7, 15] and probes == [4, 4, 4] and budget.choose([[], []], 2) == 0
    while budget.choose(draft, 1) == 0:
        pass
    for _ in range(3):  # the probe pays, and so do the rounds after it: speculation is back
        budget.update(expected=4.0, accepted=4, k=4, batch_size=1, seconds=None)
    assert budget.choose(draft, 1) == 8 and budget.probe_interval == 4


def test_round_cost_is_learned_from_wall_time():
    cost = RoundCost()
    assert cost.relative(11, 1) == pytest.approx(1.6) and cost.relative(1, 1) == 1.0  # the prior: 0.3 + 0.03 / token
    cost.observe(1, 1, 0.010)  # a plain round: 10 ms
    for tokens in (3, 5, 9, 3):
        cost.observe(tokens, 1, 0.012 + 0.001 * tokens)  # 12 ms more than plain, then 1 ms per token
    assert cost.relative(11, 1) == pytest.approx(2.3)
    assert cost.relative(4, 4) == 1.0
    one_k = RoundCost()
    one_k.observe(1, 1, 0.010)
    one_k.observe(5, 1, 0.015)  # rounds of one size only: the prior slope from there
    assert one_k.relative(9, 1) == pytest.approx(1.5 + 0.03 * 4)
