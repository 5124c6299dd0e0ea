"""PrefixIndex: exact match, LRU and eviction order on tiny indexes (no torch), plus a hypothesis run of random
inserts and matches checking the rules of its docstring."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel.cache.prefix_index import PrefixIndex


def keys(index: PrefixIndex) -> list[bytes]:
    return list(index._entries)  # least recently used first


def chain(index: PrefixIndex, *names: str, nbytes: int = 10) -> None:
    parent = None
    for name in names:
        index.insert(name.encode(), parent, name, nbytes)
        parent = name.encode()


def test_match_returns_the_longest_stored_start_and_makes_it_most_recent():
    index = PrefixIndex(max_bytes=100)
    chain(index, "a", "b", "c")
    chain(index, "x")
    assert [e.payload for e in index.match([b"a", b"b", b"q", b"c"])] == ["a", "b"]
    assert keys(index) == [b"c", b"x", b"b", b"a"]  # parents more recent than their children
    assert index.match([b"q", b"a"]) == []


def test_insert_needs_its_parent_and_refuses_duplicates():
    index = PrefixIndex(max_bytes=100)
    assert not index.insert(b"b", b"a", "b", 10)
    assert index.insert(b"a", None, "a", 10)
    assert not index.insert(b"a", None, "again", 10)
    assert index.insert(b"b", b"a", "b", 10)
    assert (len(index), index.num_bytes) == (2, 20)


def test_eviction_takes_least_recently_used_leaves_first():
    index = PrefixIndex(max_bytes=40)
    chain(index, "a", "b", "c")  # a <- b <- c
    chain(index, "x")
    index.match([b"a", b"b", b"c"])  # x is now the oldest
    assert index.insert(b"y", None, "y", 10) and keys(index)[0] == b"c" and b"x" not in index
    assert index.insert(b"z", None, "z", 10)  # evicts c, the oldest leaf; a and b stay
    assert keys(index) == [b"b", b"a", b"y", b"z"]
    assert (index.num_evictions, index.num_bytes) == (2, 40)
    assert index._entries[b"a"].num_children == 1 and index._entries[b"b"].num_children == 0


def test_insert_that_would_evict_its_own_parent_is_refused():
    index = PrefixIndex(max_bytes=25)
    chain(index, "a", "b")
    assert not index.insert(b"c", b"b", "c", 10)  # a + b + c = 30 > 25
    assert keys(index) == [b"b", b"a"] and index.num_evictions == 0
    assert not index.insert(b"big", None, "big", 26)


def test_clear():
    index = PrefixIndex(max_bytes=25)
    chain(index, "a", "b")
    index.clear()
    assert (len(index), index.num_bytes, index.num_evictions) == (0, 0, 0)


names = st.sampled_from([b"k%d" % i for i in range(12)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), names, st.one_of(st.none(), names), st.integers(1, 30)), max_size=60))
def test_random_operations_keep_the_rules(operations):
    index = PrefixIndex(max_bytes=60)
    for is_insert, key, parent, nbytes in operations:
        if is_insert:
            index.insert(key, parent, None, nbytes)
        elif key in index:  # a prompt's chain: from its first block to `key`, then a block that may be stored
            index.match([*reversed(list(index._ancestors(key))), parent or b"none"])
        entries = index._entries
        order = list(entries)
        assert index.num_bytes == sum(e.nbytes for e in entries.values()) <= index.max_bytes
        for k, entry in entries.items():
            if entry.parent is not None:
                assert entry.parent in entries, "a kept entry's parent was evicted"
                assert order.index(entry.parent) > order.index(k), "a parent is older than its child"
            assert entry.num_children == sum(1 for e in entries.values() if e.parent == k)
