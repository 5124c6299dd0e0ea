"""BlockPool: exact block ids, reference counts and free lists on tiny pools. No torch."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel import BlockPool, OutOfBlocksError


def free_list(pool: BlockPool) -> list[int]:
    return list(pool._free)


def refcounts(pool: BlockPool) -> list[int]:
    return [pool.refcount(b) for b in range(pool.num_blocks)]


def test_fresh_pool_is_all_free():
    pool = BlockPool(4)
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (4, 4, 0)
    assert pool.lowest_free_block == 0
    assert free_list(pool) == [0, 1, 2, 3]
    assert refcounts(pool) == [0, 0, 0, 0]
    assert not pool.growable


def test_empty_pool():
    pool = BlockPool(0)
    assert (pool.num_blocks, pool.num_free_blocks, pool.lowest_free_block) == (0, 0, None)
    assert pool.allocate(0) == []
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_allocate_hands_out_lowest_ids_first():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert refcounts(pool) == [1, 1, 1, 1, 1, 0]
    assert free_list(pool) == [5]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.lowest_free_block) == (1, 5, 5)


def test_allocate_zero_takes_nothing():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.allocate(0, start=1) == []
    assert free_list(pool) == [0, 1, 2]


def test_allocate_takes_requested_run_when_all_free():
    pool = BlockPool(8)
    assert pool.allocate(2, start=4) == [4, 5]
    assert free_list(pool) == [0, 1, 2, 3, 6, 7]
    assert refcounts(pool) == [0, 0, 0, 0, 1, 1, 0, 0]
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2, start=6) == [6, 7]
    assert free_list(pool) == [2, 3]


def test_allocate_falls_back_to_lowest_when_run_is_not_free():
    pool = BlockPool(8)
    assert pool.allocate(1, start=5) == [5]
    assert pool.allocate(2, start=4) == [0, 1]  # 5 is taken: the run 4..5 is not free
    assert pool.allocate(2, start=6) == [6, 7]
    assert pool.allocate(3, start=2) == [2, 3, 4]
    assert free_list(pool) == []


@pytest.mark.parametrize("start", [-1, 3, 4, 100])
def test_allocate_falls_back_when_run_leaves_the_pool(start):
    pool = BlockPool(4)
    assert pool.allocate(2, start=start) == [0, 1]
    assert free_list(pool) == [2, 3]


def test_share_and_free_count_references():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.share([0])
    pool.share([0, 1])
    assert refcounts(pool) == [3, 2, 0, 0]
    pool.free([0, 1])
    assert refcounts(pool) == [2, 1, 0, 0]
    assert free_list(pool) == [2, 3]
    pool.free([1])
    assert free_list(pool) == [1, 2, 3]
    pool.free([0, 0])
    assert refcounts(pool) == [0, 0, 0, 0]
    assert free_list(pool) == [0, 1, 2, 3]


def test_free_returns_ids_to_the_sorted_free_list():
    pool = BlockPool(6)
    assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]
    pool.free([4, 1, 3])
    assert free_list(pool) == [1, 3, 4]
    assert pool.lowest_free_block == 1
    pool.free([5, 0])
    assert free_list(pool) == [0, 1, 3, 4, 5]
    assert pool.allocate(3) == [0, 1, 3]
    assert pool.allocate(2, start=4) == [4, 5]


def test_double_free_asserts():
    pool = BlockPool(3)
    pool.allocate(2)
    pool.free([1])
    with pytest.raises(AssertionError, match="double free of block 1"):
        pool.free([1])
    with pytest.raises(AssertionError, match="double free of block 2"):
        pool.free([2])


def test_share_of_free_block_asserts():
    pool = BlockPool(3)
    with pytest.raises(AssertionError, match="share of free block 0"):
        pool.share([0])


def test_out_of_blocks_is_a_value_error_saying_what_was_needed():
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    with pytest.raises(ValueError) as info:
        pool.allocate(4)
    error = info.value
    assert isinstance(error, OutOfBlocksError)
    assert (error.num_needed, error.num_free, error.num_blocks) == (2, 2, 3)
    assert "2 more blocks needed, 2 free of 3 in the pool" in str(error)
    assert "num_blocks" in str(error) and "max_memory" in str(error)


def test_out_of_blocks_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(1, start=2)
    pool.share([2])
    before = (free_list(pool), refcounts(pool), pool.num_blocks)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4, start=0)
    assert (free_list(pool), refcounts(pool), pool.num_blocks) == before
    assert pool.allocate(3) == [0, 1, 3]


def test_can_allocate():
    pool = BlockPool(3)
    pool.allocate(1)
    assert pool.can_allocate(0) and pool.can_allocate(2)
    assert not pool.can_allocate(3)
    assert BlockPool(0, growable=True).can_allocate(100)


def test_grow_appends_free_blocks_at_the_end():
    pool = BlockPool(2)
    pool.allocate(2)
    pool.grow(3)
    assert pool.num_blocks == 5
    assert free_list(pool) == [2, 3, 4]
    assert refcounts(pool) == [1, 1, 0, 0, 0]


def test_growable_pool_grows_instead_of_raising():
    pool = BlockPool(2, growable=True)
    assert pool.allocate(1) == [0]
    assert pool.allocate(3) == [1, 2, 3]  # short by 2: grows by max(2, 2 blocks) to 4
    assert pool.num_blocks == 4 and free_list(pool) == []
    assert pool.allocate(1) == [4]  # grows by max(1, 4) to 8
    assert pool.num_blocks == 8 and free_list(pool) == [5, 6, 7]
    assert refcounts(pool) == [1, 1, 1, 1, 1, 0, 0, 0]


def test_growable_empty_pool_grows_to_the_request():
    pool = BlockPool(0, growable=True)
    assert pool.allocate(3, start=5) == [0, 1, 2]
    assert pool.num_blocks == 3


@pytest.mark.parametrize("num_blocks", [-1, 1.5, True, "4", None])
def test_bad_num_blocks(num_blocks):
    with pytest.raises(ValueError, match="`num_blocks` must be a non-negative int"):
        BlockPool(num_blocks)


# One step of a random sequence: ("alloc", num, start) | ("share", index) | ("free", index), where `index` picks one
# of the references held so far.
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 4), st.none() | st.integers(-1, 9)),
        st.tuples(st.just("share"), st.integers(0, 50)),
        st.tuples(st.just("free"), st.integers(0, 50)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(0, 8), growable=st.booleans(), steps=_steps)
def test_pool_matches_a_reference_model(num_blocks, growable, steps):
    """Refcounts equal references held; free list = refcount-0 blocks, sorted; allocation is lowest-first or the
    requested run; a refused allocation changes nothing."""
    pool = BlockPool(num_blocks, growable=growable)
    held: list[int] = []  # one entry per reference
    for step in steps:
        before = (free_list(pool), refcounts(pool))
        if step[0] == "alloc":
            _, num, start = step
            free = free_list(pool)
            run = list(range(start, start + num)) if start is not None else None
            try:
                blocks = pool.allocate(num, start=start)
            except OutOfBlocksError:
                assert not growable and num > len(free)
                assert (free_list(pool), refcounts(pool)) == before
                continue
            if run is not None and num > 0 and set(run) <= set(free):
                assert blocks == run
            else:
                grown = list(range(len(before[1]), pool.num_blocks))  # ids a growable pool appended
                assert blocks == (free + grown)[:num]
            held += blocks
        elif held:
            block = held[step[1] % len(held)]
            if step[0] == "share":
                pool.share([block])
                held.append(block)
            else:
                pool.free([block])
                held.remove(block)
        assert refcounts(pool) == [held.count(b) for b in range(pool.num_blocks)]
        assert free_list(pool) == [b for b in range(pool.num_blocks) if b not in held]
    pool.free(list(held))
    assert pool.num_used_blocks == 0



# --- cached blocks: the engine's prefix cache ----------------------------------------------------------------------


def test_cached_blocks_wait_in_the_free_queue_after_the_uncached_ones():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.cache_block(0, b"a")
    pool.cache_block(1, b"b")
    pool.free([2, 1, 0])  # a sequence's blocks, last first
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (4, 0, 2)
    assert free_list(pool) == [2, 3] and list(pool._cached_free) == [1, 0]
    assert pool.allocate(3) == [2, 3, 1]  # uncached first, then the least recently freed cached block, evicted
    assert (pool.cached_block(b"b"), pool.key_of(1), pool.cached_block(b"a"), pool.key_of(0)) == (None, None, 0, b"a")
    assert pool.allocate(1) == [0] and pool.num_cached_blocks == 0


def test_a_prefix_hit_shares_a_cached_free_block_out_of_the_queue():
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, b"a")
    pool.cache_block(1, b"a")  # the key already names block 0: ignored
    pool.cache_block(0, b"c")  # block 0 already holds a key: ignored
    assert (pool.key_of(0), pool.key_of(1), pool.cached_block(b"c")) == (b"a", None, None)
    pool.free([1, 0])
    assert free_list(pool) == [1, 2] and list(pool._cached_free) == [0]
    pool.share([pool.cached_block(b"a")])
    assert (pool.refcount(0), pool.num_free_blocks, list(pool._cached_free)) == (1, 2, [])
    assert pool.allocate(2) == [1, 2]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)  # block 0 is in use again: not evictable
    pool.free([0])
    assert list(pool._cached_free) == [0] and pool.allocate(1) == [0]


def test_cache_of_free_block_asserts():
    pool = BlockPool(2)
    with pytest.raises(AssertionError, match="cache of free block 1"):
        pool.cache_block(1, b"a")


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]), st.integers(0, 50)), max_size=50))
def test_cached_free_queue_matches_a_reference_model(steps):
    """Free queue = uncached free blocks sorted, then cached free blocks in the order they were freed; allocation
    takes its front and evicts the cached blocks it takes; a hit shares a cached block out of the queue."""
    pool = BlockPool(6)
    held: list[int] = []
    keys: dict[int, bytes] = {}  # block -> key
    cached_free: list[int] = []  # eviction order
    for op, n in steps:
        if op == "alloc":
            num = n % 4
            uncached = [b for b in range(6) if b not in held and b not in keys]
            if num > len(uncached) + len(cached_free):
                continue
            expected = (uncached + cached_free)[:num]
            assert pool.allocate(num) == expected
            for block in expected[len(uncached):]:
                cached_free.remove(block)
                del keys[block]
            held += expected
        elif op == "free" and held:
            block = held.pop(n % len(held))
            pool.free([block])
            if block not in held and block in keys:
                cached_free.append(block)
        elif op == "cache" and held:
            block, key = held[n % len(held)], bytes([n % 7])
            pool.cache_block(block, key)
            if block not in keys and key not in keys.values():
                keys[block] = key
        elif op == "hit" and cached_free:
            block = cached_free.pop(n % len(cached_free))
            pool.share([pool.cached_block(keys[block])])
            held.append(block)
        assert [pool.refcount(b) for b in range(6)] == [held.count(b) for b in range(6)]
        assert list(pool._cached_free) == cached_free
        assert {b: pool.key_of(b) for b in keys} == keys and pool.num_cached_blocks == len(keys)
