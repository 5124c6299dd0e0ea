"""TreeSizer: which prefix of the candidate list a Medusa step verifies, from counterfactual acceptance and timing."""

import pytest

from hf_accel.speculative.tree import DEFAULT_TREE, build_tree
from hf_accel.speculative.tree_size import TreeSizer, prefix_sizes


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


def test_explores_largest_first_then_every_size():
    sizer = TreeSizer((0, 2, 8))
    chosen = timed(sizer, lambda size: 1.0, [0, 1], steps=4)
    assert chosen[:4] == [8, 8, 2, 0]  # the first step's time is not kept (cold caches), so 8 runs again


def test_flat_cost_picks_whole_tree_and_steep_cost_with_no_acceptance_picks_plain_steps():
    gpu = TreeSizer((0, 1, 4, 16))
    assert timed(gpu, lambda size: 1.0, [0, 1, 9], steps=40)[-10:].count(16) == 10
    cpu = TreeSizer((0, 1, 4, 16), refresh=0)
    assert set(timed(cpu, lambda size: 1.0 + 0.1 * size, [], steps=40)[-10:]) == {0}


def test_balances_tokens_against_time_and_refreshes_the_whole_tree():
    sizer = TreeSizer((0, 1, 4, 16), refresh=16)
    # size 4 gains 2 tokens for 1.4 s (2.1 tok/s-units); 16 gains 3 for 2.6 s; 1 gains 1 for 1.1 s; plain 1 for 1
    chosen = timed(sizer, lambda size: 1.0 + 0.1 * size, [0, 2, 20], steps=48)
    assert chosen[16] == chosen[32] == 16  # the refresh steps
    assert {chosen[i] for i in range(6, 48) if i % 16} == {4}


def test_bad_sizes():
    for sizes in [(), (2, 1), (1, 1), (-1, 2)]:
        with pytest.raises(ValueError, match="sizes"):
            TreeSizer(sizes)
