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
    budget = DraftBudget(max_tokens=4, token_cost=0.1)
    draft = [[1.0, 1.0, 1.0, 1.0]]
    assert budget.choose(draft, 1) == 4
    rounds = 0
    while budget.choose(draft, 1) > 0:  # nothing is ever accepted
        budget.update(expected=4.0, accepted=0, k=4, batch_size=1, seconds=None)
        rounds += 1
    assert rounds < 10 and budget.trust < 0.1
    waits = []
    for _ in range(3):  # switched off: a probe after 8 rounds, then after 16, 32 while probes keep failing
        off = 0
        while budget.choose(draft, 1) == 0:
            off += 1
        waits.append(off)
        budget.update(expected=4.0, accepted=0, k=4, batch_size=1, seconds=None)
    # 8 rounds off then a probe (the first was the while test above), 16, 32: the probe is the last round counted
    assert waits == [6, 15, 31] and budget.choose([[], []], 2) == 0
    while budget.choose(draft, 1) == 0:
        pass
    for _ in range(2):  # the probe pays, and so do the rounds after it: speculation is back
        budget.update(expected=4.0, accepted=4, k=4, batch_size=1, seconds=None)
    assert budget.choose(draft, 1) == 4 and budget.probe_interval == 8


def test_round_cost_is_learned_from_wall_time():
    cost = RoundCost()
    assert cost.relative(11, 1) == pytest.approx(1.5)  # the prior: 5% of a step per extra token
    for tokens in (1, 3, 5, 1, 9, 1):
        cost.observe(tokens, 0.010 + 0.002 * tokens)  # 12 ms for one token, 2 ms per extra one
    assert cost.relative(11, 1) == pytest.approx(32 / 12)
    assert cost.relative(4, 4) == pytest.approx(1.0)
