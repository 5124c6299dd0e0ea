"""TreeSizer: which prefix of the candidate list a Medusa step verifies, from counterfactual acceptance and timing."""

import pytest

from hf_accel.speculative.tree import DEFAULT_TREE, build_tree
from hf_accel.speculative.tree_size import TreeSizer, batch_progress, prefix_sizes


def test_prefix_sizes_keep_only_closed_prefixes():
    paths = [(0,), (0, 0), (1,), (0, 0, 0), (2,), (1, 0), (3,), (0, 1), (4,)]
    assert prefix_sizes(paths) == (0, 1, 2, 3, 4, 6, 8, 9)
    assert prefix_sizes([(0,), (1, 0), (1,)]) == (0, 1, 3)  # (0,), (1, 0): no parent for (1, 0)
    for size in prefix_sizes(list(DEFAULT_TREE))[1:]:
        build_tree(DEFAULT_TREE[:size], num_heads=4)  # every offered prefix is a valid tree


def timed(sizer: TreeSizer, seconds_of, accepted_ranks, steps: int) -> list[int]:
    """Run `steps` steps where size s costs seconds_of(s) and the chain `accepted_ranks` is accepted."""
    chosen = []
    for _ in range(steps):
        index = sizer.choose()
        chosen.append(sizer.sizes[index])
        sizer.record(index, [accepted_ranks], seconds_of(sizer.sizes[index]))
    return chosen


def test_counterfactual_acceptance_per_size():
    sizer = TreeSizer((0, 1, 2, 4, 8))
    sizer.record(4, [[0, 3, 5]], 1.0)  # ranks of the accepted chain: size 1 keeps 1, 4 keeps 2, 8 keeps 3
    assert [sizer.mean_accepted(i) for i in range(5)] == [0, 1, 1, 2, 3]
    sizer.record(1, [[]], 1.0)  # a later step at size 1 accepted nothing: sizes <= 1 average it in
    assert [sizer.mean_accepted(i) for i in range(5)] == [0, 0.5, 0.5, 1.5, 2.5]


def test_explores_whole_tree_then_plain_then_the_smallest_size_as_good_at_the_larger_ones_price():
    sizer = TreeSizer((0, 2, 4, 8), probe_share=0)
    # size 2 gains 1 token, 4 gains 2, 8 the same 2: costs 1 s + 0.1 s per candidate
    chosen = timed(sizer, lambda size: 1.0 + 0.1 * size, [0, 3, 9], steps=2)
    # no tree smaller than the whole one is timed: sizes 2 and 4 are priced at its 1.8 s (an upper bound)
    assert chosen == [8, 0] and sizer.step_seconds(1) == sizer.step_seconds(2) == pytest.approx(1.8)
    # size 4 gains what 8 does at no more cost: it runs, and stays the best
    assert timed(sizer, lambda size: 1.0 + 0.1 * size, [0, 3, 9], steps=4) == [4, 4, 4, 4]
    assert sizer.seconds == [1.0, None, 1.4, 1.8] and sizer.step_seconds(1) == pytest.approx(1.4)


def test_untimed_sizes_between_timed_trees_are_interpolated():
    sizer = TreeSizer((0, 2, 4, 8))
    sizer.record(3, [[0]], 1.8)
    sizer.record(0, [], 1.0)
    sizer.record(1, [[0]], 1.2)
    assert sizer.step_seconds(2) == pytest.approx(1.2 + (4 - 2) / (8 - 2) * 0.6)


def test_first_step_time_stands_only_until_the_size_runs_again():
    sizer = TreeSizer((0, 4))
    sizer.record(1, [[0]], 5.0)  # cold caches
    sizer.record(1, [[0]], 1.0)
    assert sizer.seconds[1] == 1.0
    sizer.record(1, [[0]], 2.0)
    assert sizer.seconds[1] == pytest.approx(1.25)  # running average from then on


def test_flat_cost_picks_whole_tree_and_steep_cost_with_no_acceptance_picks_plain_steps():
    gpu = TreeSizer((0, 1, 4, 16))
    assert timed(gpu, lambda size: 1.0, [0, 1, 9], steps=40)[-10:].count(16) == 10
    cpu = TreeSizer((0, 1, 4, 16), probe_share=0)
    assert timed(cpu, lambda size: 1.0 + 0.1 * size, [], steps=40) == [16] + [0] * 39


def test_probes_the_size_above_the_best_within_its_share_of_time():
    sizer = TreeSizer((0, 1, 4, 16), probe_share=0.05)
    # size 1 gains 1 token for 2 s, plain 1 token for 1 s: plain steps win
    chosen = timed(sizer, lambda size: 1.0 + size, [0, 2], steps=500)
    probes = [i for i in range(2, 500) if chosen[i] != 0]
    assert chosen[:2] == [16, 0] and {chosen[i] for i in probes} == {1}
    # untimed, size 1 is priced at the whole tree's 17 s: the first probe waits for 16 s / 0.05 of plain steps;
    # timed, it costs 1 s more than a plain step: one probe per ~20 s of plain steps from then on
    assert 320 <= probes[0] <= 325
    assert all(20 <= later - earlier <= 22 for earlier, later in zip(probes, probes[1:]))


def test_a_probe_that_wins_resumes_exploring_upward():
    sizer = TreeSizer((0, 1, 4, 16), probe_share=0.5)
    costs = {0: 1.0, 1: 3.0, 4: 1.5, 16: 9.0}
    chosen = timed(sizer, costs.get, [0, 2], steps=4)
    assert chosen == [16, 0, 0, 0]  # size 1 gains 1 token, priced at 9 s until it runs: not worth it
    costs[1] = 1.1  # size 1 is cheap after all: a probe finds it, then size 4 is found above it
    chosen = timed(sizer, costs.get, [0, 2], steps=60)
    assert 1 in chosen[:20]
    assert chosen[-10:].count(4) >= 8 and set(chosen[-10:]) <= {4, 16}  # and a probe of 16 now and then


def test_a_batch_gains_what_its_furthest_behind_rows_gain():
    sizer = TreeSizer((0, 1, 4))
    # rows equally far behind: a step takes off what the row that accepts least accepts (the batch ends with it)
    sizer.record(2, [[0, 3], [], [0]], 1.0)  # size 1 keeps 1, 0, 1; size 4 keeps 2, 0, 1
    assert [sizer.mean_accepted(i) for i in range(3)] == [0, 0, 0]
    sizer = TreeSizer((0, 1, 4))
    # row 1 is ahead (6 left): rows 0 and 2 count; size 1 takes row 0 from 10 to 8, size 4 to 7 (row 2 then too)
    sizer.record(2, [[0, 3], [], [0]], 1.0, remaining=[10, 6, 9])
    assert [sizer.mean_accepted(i) for i in range(3)] == [0, 1, 2]


def test_batch_progress_exact():
    assert batch_progress([2, 0, 1]) == 1  # rows level: the least emitted (root + 0)
    assert batch_progress([2, 0, 1], remaining=[10, 6, 9]) == 3  # 10 -> 7 while row 2 goes 9 -> 7
    assert batch_progress([1, 3], remaining=[5, 5]) == 2  # the slower of two level rows
    assert batch_progress([3, 0], remaining=[2, 1]) == 2  # nobody emits past its end: both end
    assert batch_progress([]) == 1  # a plain step: one token per row


def test_bad_sizes():
    for sizes in [(), (2, 1), (1, 1), (-1, 2)]:
        with pytest.raises(ValueError, match="sizes"):
            TreeSizer(sizes)
    with pytest.raises(ValueError, match="probe_share"):
        TreeSizer((0, 1), probe_share=1.5)
