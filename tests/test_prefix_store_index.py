"""The PrefixStore's index (a `BlockPool` whose free queue is the LRU order): exact match, LRU and eviction order on
tiny stores, plus a hypothesis run of random saves and hits checking the rules of prefix_store.py's docstring. Blocks
are named by short keys and hold zeros; only the bookkeeping is checked."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel import PrefixStore
from tiny_llama import tiny_llama

BLOCK_BYTES = 2048  # tiny_llama at block_size 4 (see test_prefix_store.py)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def make_store(model, num_blocks: int) -> PrefixStore:
    return PrefixStore(model, max_memory=num_blocks * BLOCK_BYTES, block_size=4)


def keys(store: PrefixStore) -> list[bytes]:
    """Stored keys, least recently used first."""
    return [store._slots.key_of(slot) for slot in store._slots._cached_free]


def save(store: PrefixStore, *names: str, new: tuple[str, ...] | None = None) -> None:
    """Store the chain `names` (each name a key), offering the blocks `new` (default: all of them)."""
    offered = names if new is None else new
    blocks = torch.zeros((2, 2, len(offered), 4, 2, 16))
    store._insert([n.encode() for n in names], blocks, {n.encode(): i for i, n in enumerate(offered)})


def test_match_returns_the_longest_stored_start_and_makes_it_most_recent(model):
    store = make_store(model, 10)
    save(store, "a", "b", "c")
    save(store, "x")
    assert keys(store) == [b"c", b"b", b"a", b"x"]  # a saved chain: its first block most recent
    assert len(store._match([b"a", b"b", b"q", b"c"])) == 2
    assert keys(store) == [b"c", b"x", b"b", b"a"]  # parents more recent than their children
    assert store._match([b"q", b"a"]) == []


def test_a_block_needs_its_parent_and_is_stored_once(model):
    store = make_store(model, 10)
    save(store, "a", "b", new=("b",))  # a is neither stored nor offered: b cannot be stored
    assert keys(store) == []
    save(store, "a")
    save(store, "a", new=("a",))
    save(store, "a", "b", new=("b",))
    assert keys(store) == [b"b", b"a"] and store.stats().blocks == 2 and store.stats().bytes == 2 * BLOCK_BYTES


def test_eviction_takes_least_recently_used_leaves_first(model):
    store = make_store(model, 4)
    save(store, "a", "b", "c")  # a <- b <- c
    save(store, "x")
    store._match([b"a", b"b", b"c"])  # x is now the oldest
    save(store, "y")
    assert keys(store) == [b"c", b"b", b"a", b"y"]
    save(store, "z")  # evicts c, the oldest leaf; a and b stay
    assert keys(store) == [b"b", b"a", b"y", b"z"]
    assert (store.stats().evictions, store.stats().bytes) == (2, 4 * BLOCK_BYTES)


def test_a_block_that_would_evict_its_own_parent_is_not_stored(model):
    store = make_store(model, 2)
    save(store, "a", "b")
    save(store, "a", "b", "c", new=("c",))  # a + b + c: three blocks in a store of two
    assert keys(store) == [b"b", b"a"] and store.stats().evictions == 0


def test_clear_keeps_the_counters(model):
    store = make_store(model, 2)
    save(store, "a", "b")
    save(store, "x")
    store.clear()
    assert (keys(store), store.stats().blocks, store.stats().bytes, store.stats().evictions) == ([], 0, 0, 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=5)), max_size=40))
def test_random_saves_and_hits_keep_the_rules(model, operations):
    store = make_store(model, 6)
    for is_save, tokens in operations:
        chain = [bytes(tokens[: j + 1]) for j in range(len(tokens))]  # a block's key: its whole prefix
        if is_save:
            store._insert(chain, torch.zeros((2, 2, len(chain), 4, 2, 16)), {k: i for i, k in enumerate(chain)})
        else:
            store._match(chain)
        order = keys(store)
        assert len(order) == store.stats().blocks <= 6
        for key in order:
            if len(key) > 1:
                assert key[:-1] in order, "a kept block's parent was evicted"
                assert order.index(key[:-1]) > order.index(key), "a parent is older than its child"
