"""`DraftLength`: a chain drafter's k, the most expected tokens per measured cost (`RoundCost`): what shorter chains
would have gained, the furthest-behind row deciding, growth past the last k, plain rounds timed only while
speculation is in question, the off-switch and its probes, and the compiled loops' k >= 1."""

import pytest

import hf_accel
from hf_accel.speculative.draft_length import CONFIDENT, GROWTH, PLAIN_SPACING, DraftLength

PLAIN = 0.010  # seconds of a plain round in these simulations


def _run(length: DraftLength, rounds: int, accept, seconds_per_k, batch_size: int = 1) -> list[int]:
    """`rounds` rounds of `length`'s choosing; `accept(k)` -> accepted per row, `seconds_per_k(k)` -> the round's
    time. The k of every round."""
    ks = []
    for _ in range(rounds):
        k = length.next(budget=1000, batch_size=batch_size)
        length.update(k, accept(k), batch_size, seconds_per_k(k))
        ks.append(k)
    return ks


def test_k_starts_at_num_tokens_grows_by_at_most_growth_and_stays_within_the_budget():
    length = DraftLength(num_tokens=4, max_tokens=16)
    assert length.next(budget=100) == 4 and length.next(budget=3) == 2 and length.next(budget=1) == 0
    ks = _run(length, 8, lambda k: [k], lambda k: PLAIN * (1.1 + 0.02 * k))  # cheap, every candidate accepted
    assert ks[:4] == [4, 4 + GROWTH, 4 + 2 * GROWTH, 4 + 3 * GROWTH] and ks[-1] == 16
    assert 0 not in ks  # clearly paying: no plain round is spent on measuring


def test_the_furthest_behind_row_decides():
    length = DraftLength(num_tokens=6, max_tokens=8)
    # batch of two: one row accepts everything, the other only the first candidate: longer chains gain the call nothing
    ks = _run(length, 30, lambda k: [k, min(k, 1)], lambda k: PLAIN * (1.3 + 0.2 * k) if k else PLAIN,
              batch_size=2)
    assert ks[1] < 6 and ks[-12:].count(1) >= 8  # a longer chain is retried now and then, as its evidence ages
    assert 0 not in ks[-12:]  # k = 1 pays: (1 + 1) / 1.5 plain rounds


def test_shorter_chains_are_priced_from_a_longer_round():
    length = DraftLength(num_tokens=8, max_tokens=8)
    length.update(8, [3], 1, None)  # one round: 3 of 8 accepted, so chains of 1..3 would have gained 1 each, 4 none
    assert length.added[1:6] == [1.0, 1.0, 1.0, 0.0, 0.0] and length.tried[1:6] == [1.0, 1.0, 1.0, 1.0, 0.0]
    rates = length.rates(8, 1)
    assert rates[3] > rates[2] > rates[1] and rates[4] - rates[3] < rates[3] - rates[2]  # 4.. shrunk, not ruled out
    for _ in range(4):  # the same outcome again: past 3 nothing pays
        length.update(8, [3], 1, None)
    rates = length.rates(8, 1)
    assert max(range(1, 9), key=rates.__getitem__) == 3


def test_speculation_that_does_not_pay_is_measured_switched_off_and_probed():
    length = DraftLength(num_tokens=4, max_tokens=8)
    ks = _run(length, 40, lambda k: [0], lambda k: PLAIN * (1.0 + 0.3 * k) if k else PLAIN)  # nothing accepted
    plain_while_in_question = [i for i, k in enumerate(ks[:4 * PLAIN_SPACING + 1]) if k == 0]
    # every PLAIN_SPACING-th round: the first one's time is left out, so four of them time three plain rounds
    assert plain_while_in_question == [PLAIN_SPACING * n for n in (1, 2, 3, 4)]
    assert length.cost(1).is_measured
    first_off = ks.index(0, 4 * PLAIN_SPACING + 1)
    tail = ks[first_off:]
    probes = [i for i, k in enumerate(tail) if k]
    assert probes[0] <= 4 and probes[1] - probes[0] == 16  # a probe after 4 rounds off, then after 16
    assert all(k <= 4 for k in tail)  # a probe drafts at most PROBE_TOKENS


def test_a_confident_speculator_never_times_a_plain_round_and_the_compiled_loops_never_switch_off():
    length = DraftLength(num_tokens=2, max_tokens=6)
    ks = _run(length, 30, lambda k: [k], lambda k: PLAIN * (1.2 + 0.05 * k))
    assert 0 not in ks and not length.cost(1).is_measured and length.rates(6, 1)[6] >= CONFIDENT
    never_off = DraftLength(num_tokens=2, max_tokens=6, allow_off=False)
    assert 0 not in _run(never_off, 30, lambda k: [0], lambda k: PLAIN * (1.0 + 0.5 * k))


def test_the_first_round_of_each_length_is_not_timed():
    length = DraftLength(num_tokens=3, max_tokens=3)
    length.update(3, [3], 1, 5.0)  # compiled a new shape: seconds of one-off cost
    assert length.cost(1).num_speculating == 0
    length.update(3, [3], 1, 0.02)
    length.update(3, [3], 2, 0.03)  # a new batch size is a new shape too
    assert length.cost(1).num_speculating == 1 and length.cost(2).num_speculating == 0


@pytest.mark.parametrize("kwargs,name", [({"max_tokens": 0}, "max_draft_tokens"),
                                         ({"num_tokens": 9, "max_tokens": 8}, "num_draft_tokens")])
def test_bad_lengths_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        hf_accel.DraftLength(**kwargs)


def test_neighbours_of_the_best_k_are_tried_so_the_cost_line_spans_the_choice():
    length = DraftLength(num_tokens=3, max_tokens=8, allow_off=False)
    # the first 3 candidates are always accepted, the 4th never: k = 3 is best, yet 2 and 4 run now and then
    ks = _run(length, 36, lambda k: [min(k, 3)], lambda k: PLAIN * (1.3 + 0.2 * k))
    assert ks[-12:].count(3) >= 8 and {2, 4} <= set(ks[-12:])
    assert length.cost(1)._line() is not None  # rounds of several sizes: the line is fitted, not the prior
