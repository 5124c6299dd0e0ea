"""`RoundCost`: a round's measured cost relative to a plain round, by tokens forwarded (the one model `DraftBudget` and
`TreeSizer` price rounds with): the prior until measured, the median of plain rounds, a line through speculating
rounds, and its floor."""

import pytest

from hf_accel.speculative.round_cost import RoundCost


def test_round_cost_is_learned_from_wall_time():
    cost = RoundCost()
    assert cost.relative(11, 1) == pytest.approx(1.6) and cost.relative(1, 1) == 1.0  # the prior: 0.3 + 0.03 / token
    for seconds in (0.010, 0.030, 0.010):  # plain rounds: 10 ms (the median shrugs off a slow one)
        cost.observe(1, 1, seconds)
    for tokens in (3, 5, 9, 3):
        cost.observe(tokens, 1, 0.012 + 0.001 * tokens)  # 12 ms more than plain, then 1 ms per token
    assert cost.relative(11, 1) == pytest.approx(2.3)
    assert cost.relative(4, 4) == 1.0
    one_k = RoundCost()
    for _ in range(3):
        one_k.observe(1, 1, 0.010)
    one_k.observe(5, 1, 0.015)  # rounds of one size only: the prior slope from there
    assert one_k.relative(9, 1) == pytest.approx(1.5 + 0.03 * 4)


def test_timing_noise_cannot_make_a_speculating_round_free():
    cost = RoundCost()
    for _ in range(3):
        cost.observe(4, 4, 0.010)
    for tokens in (8, 20, 36):
        cost.observe(tokens, 4, 0.009)  # speculating rounds timed faster than plain ones: noise
    assert cost.relative(36, 4) == pytest.approx(1.2)  # never below 1 + MIN_EXTRA_COST: a tiny trust cannot pay


def test_measured_after_three_plain_rounds_and_one_speculating_round():
    cost = RoundCost()
    cost.observe(5, 1, 0.015)
    for _ in range(2):
        cost.observe(1, 1, 0.010)
    assert not cost.is_measured and cost.num_plain == 2 and cost.relative(5, 1) == pytest.approx(1.3 + 0.03 * 4)
    cost.observe(1, 1, 0.010)
    assert cost.is_measured and cost.relative(5, 1) == pytest.approx(1.5)
