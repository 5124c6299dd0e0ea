"""TreeSizer: which prefix of the candidate list a Medusa round verifies, from counterfactual acceptance and the
measured round cost (`RoundCost`, the model `DraftBudget` uses too)."""

import pytest

from hf_accel.speculative.tree import DEFAULT_TREE, build_tree
from hf_accel.speculative.round_cost import RoundCost
from hf_accel.speculative.tree_size import TreeSizer, batch_progress, prefix_sizes


def test_prefix_sizes_keep_only_closed_prefixes():
    paths = [(0,), (0, 0), (1,), (0, 0, 0), (2,), (1, 0), (3,), (0, 1), (4,)]
    assert prefix_sizes(paths) == (0, 1, 2, 3, 4, 6, 8, 9)
    assert prefix_sizes([(0,), (1, 0), (1,)]) == (0, 1, 3)  # (0,), (1, 0): no parent for (1, 0)
    for size in prefix_sizes(list(DEFAULT_TREE))[1:]:
        build_tree(DEFAULT_TREE[:size], num_heads=4)  # every offered prefix is a valid tree


def timed(sizer: TreeSizer, seconds_of, accepted_ranks, rounds: int, batch_size: int = 1) -> list[int]:
    """Run `rounds` rounds where size s costs seconds_of(s) and the chain `accepted_ranks` is accepted."""
    chosen = []
    for _ in range(rounds):
        index = sizer.choose(batch_size)
        chosen.append(sizer.sizes[index])
        sizer.record(index, [accepted_ranks], seconds_of(sizer.sizes[index]), batch_size)
    return chosen


def test_counterfactual_acceptance_per_size():
    sizer = TreeSizer((0, 1, 2, 4, 8))
    sizer.record(4, [[0, 3, 5]], 1.0, 1)  # ranks of the accepted chain: size 1 keeps 1, 4 keeps 2, 8 keeps 3
    assert [sizer.mean_accepted(i) for i in range(5)] == [0, 1, 1, 2, 3]
    sizer.record(1, [[]], 1.0, 1)  # a later round at size 1 accepted nothing: sizes <= 1 average it in
    assert [sizer.mean_accepted(i) for i in range(5)] == [0, 0.5, 0.5, 1.5, 2.5]


def test_explores_whole_tree_then_plain_until_measured_then_the_smallest_size_as_good_at_less_cost():
    sizer = TreeSizer((0, 2, 4, 8), probe_share=0)
    # size 2 gains 1 token, 4 gains 2, 8 the same 2: costs 1 s + 0.1 s per candidate
    chosen = timed(sizer, lambda size: 1.0 + 0.1 * size, [0, 3, 9], rounds=4)
    # the whole tree (acceptance for every size, and the cost model's first tree round), then plain rounds until the
    # cost model has its plain rounds; smaller trees than any that ran are priced as the smallest that ran (an upper
    # bound: a tree round's fixed cost over a plain round is not measured below it), not by the line's prior slope
    assert chosen == [8, 0, 0, 0]
    assert sizer.relative_costs(1) == pytest.approx([1.0, 1.8, 1.8, 1.8])
    # size 4 gains what 8 does at no more cost: it runs (which measures it) and stays the best; size 2 is then priced
    # as size 4, and three tree rounds fit the line exactly
    assert timed(sizer, lambda size: 1.0 + 0.1 * size, [0, 3, 9], rounds=4) == [4, 4, 4, 4]
    assert sizer.relative_costs(1) == pytest.approx([1.0, 1.4, 1.4, 1.8])


def test_sizes_are_priced_by_the_shared_round_cost():
    sizer, cost = TreeSizer((0, 2, 4, 8)), RoundCost()
    rounds = [(3, 0.9), (0, 0.3), (0, 0.31), (0, 0.29), (3, 0.8), (1, 0.5), (2, 0.6)]  # (size index, seconds)
    for index, seconds in rounds:
        sizer.record(index, [[0]], seconds, 4)
        cost.observe(4 * (1 + sizer.sizes[index]), 4, seconds)
    assert sizer.relative_costs(4) == [cost.relative(4 * (1 + size), 4) for size in sizer.sizes]
    assert sizer.cost(4).is_measured and set(sizer.costs) == {4}


def test_the_first_rounds_cold_time_fades_as_tree_rounds_run():
    sizer = TreeSizer((0, 4))
    sizer.record(1, [[0]], 5.0, 1)  # the whole tree with cold caches
    for _ in range(3):
        sizer.record(0, [], 1.0, 1)
    assert sizer.relative_costs(1) == [1.0, 5.0]  # it overprices trees until they run again
    costs = []
    for _ in range(20):
        sizer.record(1, [[0]], 1.8, 1)
        costs.append(sizer.relative_costs(1)[1])
    assert costs[0] < 3.5 and costs == sorted(costs, reverse=True) and costs[-1] == pytest.approx(1.89, abs=0.01)


def test_flat_cost_picks_whole_tree_and_steep_cost_with_no_acceptance_picks_plain_rounds():
    gpu = TreeSizer((0, 1, 4, 16))
    assert timed(gpu, lambda size: 1.0, [0, 1, 9], rounds=40)[-10:].count(16) == 10
    cpu = TreeSizer((0, 1, 4, 16), probe_share=0)
    assert timed(cpu, lambda size: 1.0 + 0.1 * size, [], rounds=40) == [16] + [0] * 39


def test_probes_the_size_above_the_best_within_its_share_of_cost():
    sizer = TreeSizer((0, 1, 4, 16), probe_share=0.05)
    # size 1 gains 1 token for 2 s, plain 1 token for 1 s: plain rounds win
    chosen = timed(sizer, lambda size: 1.0 + size, [0, 2], rounds=600)
    probes = [i for i in range(5, 600) if chosen[i] != 0]
    assert chosen[:6] == [16, 0, 0, 0, 0, 0] and {chosen[i] for i in probes} == {1}
    # priced as the whole tree (17 s) until it runs, size 1 costs 16 plain rounds more: the first probe waits for that
    # over 0.05 of plain rounds; once three tree rounds fit the line, size 1 costs 1 plain round more: one probe per
    # ~20 plain rounds from then on
    assert 320 <= probes[0] <= 325
    assert all(20 <= later - earlier <= 22 for earlier, later in zip(probes[1:], probes[2:]))


def test_a_probe_that_wins_resumes_exploring_upward():
    sizer = TreeSizer((0, 1, 4, 16), probe_share=0.5)

    def costs(jump: float, per_candidate: float):
        return lambda size: 1.0 if size == 0 else jump + per_candidate * size

    chosen = timed(sizer, costs(2.5, 0.4), [0, 2], rounds=10)
    assert chosen == [16] + [0] * 9  # size 1 gains 1 token for 2.9 plain rounds: not worth it
    # tree rounds are cheap after all: a probe finds size 1, then size 4 is found above it and stays the choice
    chosen = timed(sizer, costs(1.05, 0.05), [0, 2], rounds=60)
    assert 1 in chosen[:20]
    assert chosen[-8:].count(4) >= 6 and set(chosen[-8:]) <= {4, 16}  # and a probe of 16 now and then


def test_a_batch_gains_what_its_furthest_behind_rows_gain():
    sizer = TreeSizer((0, 1, 4))
    # rows equally far behind: a round takes off what the row that accepts least accepts (the batch ends with it)
    sizer.record(2, [[0, 3], [], [0]], 1.0, 3)  # size 1 keeps 1, 0, 1; size 4 keeps 2, 0, 1
    assert [sizer.mean_accepted(i) for i in range(3)] == [0, 0, 0]
    sizer = TreeSizer((0, 1, 4))
    # row 1 is ahead (6 left): rows 0 and 2 count; size 1 takes row 0 from 10 to 8, size 4 to 7 (row 2 then too)
    sizer.record(2, [[0, 3], [], [0]], 1.0, 3, remaining=[10, 6, 9])
    assert [sizer.mean_accepted(i) for i in range(3)] == [0, 1, 2]


def test_batch_progress_exact():
    assert batch_progress([2, 0, 1]) == 1  # rows level: the least emitted (root + 0)
    assert batch_progress([2, 0, 1], remaining=[10, 6, 9]) == 3  # 10 -> 7 while row 2 goes 9 -> 7
    assert batch_progress([1, 3], remaining=[5, 5]) == 2  # the slower of two level rows
    assert batch_progress([3, 0], remaining=[2, 1]) == 2  # nobody emits past its end: both end
    assert batch_progress([]) == 1  # a plain round: one token per row


def test_bad_sizes():
    for sizes in [(), (2, 1), (1, 1), (-1, 2)]:
        with pytest.raises(ValueError, match="sizes"):
            TreeSizer(sizes)
    with pytest.raises(ValueError, match="probe_share"):
        TreeSizer((0, 1), probe_share=1.5)
