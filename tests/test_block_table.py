"""BlockTables: exact tables, copy-on-write copies and reference counts on tiny pools, plus a stateful property test
over random operation sequences. No torch."""

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_accel.cache.block_pool import BlockPool, OutOfBlocksError
from hf_accel.cache.block_table import BlockTables, StridedLayout


def make_tables(num_blocks: int, block_size: int = 4, growable: bool = False) -> BlockTables:
    return BlockTables(BlockPool(num_blocks, growable=growable), block_size)


def refcounts(tables: BlockTables) -> list[int]:
    return [tables.pool.refcount(b) for b in range(tables.pool.num_blocks)]


def snapshot(tables: BlockTables) -> tuple:
    pool = tables.pool
    return [list(r) for r in tables.rows], tables.num_tokens, tables.version, refcounts(tables), list(pool._free)


# --- prefill ------------------------------------------------------------------------------------------------------


def test_prefill_without_groups_lays_rows_out_strided():
    tables = make_tables(16)
    tables.prefill(6, [0, 1, 2])
    assert tables.rows == [[0, 1], [2, 3], [4, 5]]
    assert (tables.num_rows, tables.num_tokens) == (3, 6)
    assert refcounts(tables)[:7] == [1, 1, 1, 1, 1, 1, 0]
    assert tables.pool.num_free_blocks == 10
    assert tables.strided_layout() == StridedLayout(first_block=0, row_stride=2)


def test_prefill_reserves_a_stride_so_growing_rows_stay_strided():
    tables = make_tables(16)
    assert tables.prefill_need(6, [0, 1], reserve_tokens=12) == 6
    tables.prefill(6, [0, 1], reserve_tokens=12)
    assert tables.rows == [[0, 1], [3, 4]]
    assert tables.pool.refcount(2) == 0  # left free for row 0 to grow into
    assert tables.strided_layout() == StridedLayout(0, 3)
    assert tables.append(2) == [] and tables.rows == [[0, 1], [3, 4]]  # 8 tokens: still two blocks
    assert tables.append(1) == [] and tables.rows == [[0, 1, 2], [3, 4, 5]]
    assert tables.strided_layout() == StridedLayout(0, 3)
    assert tables.append(4) == []  # 13 tokens: past the reservation, next blocks are the lowest free
    assert tables.rows == [[0, 1, 2, 6], [3, 4, 5, 7]]
    assert tables.strided_layout() is None


def test_prefill_with_groups_shares_full_blocks_not_the_partial_last():
    tables = make_tables(16)
    tables.prefill(10, [0, 0, 2, 2])  # 2 full blocks + 2 tokens
    assert tables.rows == [[0, 1, 4], [0, 1, 5], [2, 3, 6], [2, 3, 7]]
    assert refcounts(tables)[:9] == [2, 2, 2, 2, 1, 1, 1, 1, 0]
    assert tables.strided_layout() is None


def test_prefill_with_groups_and_reserve_keeps_private_blocks_consecutive():
    tables = make_tables(16)
    assert tables.prefill_need(6, [0, 0], reserve_tokens=16) == 7  # 1 shared + a stride of 3 per row
    tables.prefill(6, [0, 0], reserve_tokens=16)
    assert tables.rows == [[0, 1], [0, 4]]
    tables.append(3)
    tables.append(4)
    assert tables.rows == [[0, 1, 2, 3], [0, 4, 5, 6]]
    assert refcounts(tables)[:8] == [2, 1, 1, 1, 1, 1, 1, 0]


def test_prefill_of_whole_blocks_shares_every_block():
    tables = make_tables(16)
    tables.prefill(8, [0, 0])
    assert tables.rows == [[0, 1], [0, 1]]
    assert refcounts(tables)[:3] == [2, 2, 0]
    assert tables.append(1) == []  # the shared blocks are full: no copy, a new private block each
    assert tables.rows == [[0, 1, 2], [0, 1, 3]]


def test_prefill_with_a_singleton_group_beside_a_pair():
    tables = make_tables(16)
    tables.prefill(5, [0, 1, 1])
    assert tables.rows == [[0, 2], [1, 3], [1, 4]]
    assert refcounts(tables)[:6] == [1, 2, 1, 1, 1, 0]


def test_prefill_too_big_for_the_pool_changes_nothing():
    tables = make_tables(5)
    before = snapshot(tables)
    with pytest.raises(OutOfBlocksError, match="1 more blocks needed, 5 free of 5"):
        tables.prefill(9, [0, 1])  # 3 blocks per row
    assert snapshot(tables) == before
    tables.prefill(9, [0, 0])  # shared: 2 + 2 * 1 blocks fit
    assert tables.rows == [[0, 1, 2], [0, 1, 3]]



# --- eviction (sliding windows) -----------------------------------------------------------------------------------


def test_evict_before_frees_only_blocks_wholly_before_the_token():
    tables = make_tables(16)
    tables.prefill(10, [0, 1])  # rows [[0, 1, 2], [3, 4, 5]]
    tables.evict_before(3)  # token 3 is still in block 0
    assert (tables.rows, tables.first_token, tables.first_block) == ([[0, 1, 2], [3, 4, 5]], 3, 0)
    tables.evict_before(9)  # blocks 0 and 1 of each row hold tokens 0-7 only
    assert (tables.rows, tables.first_token, tables.first_block) == ([[2], [5]], 9, 2)
    assert refcounts(tables)[:6] == [0, 0, 1, 0, 0, 1]
    tables.append(3)  # 13 tokens: block 3 of each row, right after its block 2 where free
    assert tables.rows == [[2, 3], [5, 6]]


def test_prefill_from_a_first_token_allocates_only_the_kept_blocks():
    tables = make_tables(16)
    tables.prefill(20, [0, 1], first_token=13)  # tokens 13-19: blocks 3 and 4
    assert (tables.rows, tables.first_block, tables.pool.num_used_blocks) == ([[0, 1], [2, 3]], 3, 4)
    tables.crop(2)  # 18 tokens: still blocks 3 and 4
    assert tables.rows == [[0, 1], [2, 3]]
    tables.release()
    assert (tables.rows, tables.first_token, tables.pool.num_used_blocks) == ([], 0, 0)

# --- append -------------------------------------------------------------------------------------------------------


def test_append_across_block_boundaries():
    tables = make_tables(24)
    tables.prefill(10, [0, 0, 2, 2])
    version = tables.version
    assert tables.append(2) == []  # fills the partial last blocks
    assert (tables.num_tokens, tables.version) == (12, version)
    assert tables.append(1) == []
    assert tables.rows == [[0, 1, 4, 8], [0, 1, 5, 9], [2, 3, 6, 10], [2, 3, 7, 11]]
    assert tables.version > version
    assert tables.append(9) == []  # 22 tokens: two more blocks per row
    assert [len(row) for row in tables.rows] == [6, 6, 6, 6]
    assert tables.rows[0][4:] == [12, 13]


def test_append_out_of_blocks_changes_nothing():
    tables = make_tables(5)
    tables.prefill(4, [0, 1])
    before = snapshot(tables)
    with pytest.raises(OutOfBlocksError, match="1 more blocks needed, 3 free of 5"):
        tables.append(8)  # 12 tokens: 2 more blocks per row
    assert snapshot(tables) == before
    assert tables.append(1) == []
    assert tables.rows == [[0, 2], [1, 3]]


# --- copy-on-write ------------------------------------------------------------------------------------------------


def test_copy_on_write_after_reorder_copies_once():
    tables = make_tables(8)
    tables.prefill(6, [0, 1])
    assert tables.rows == [[0, 1], [2, 3]]
    tables.reorder([0, 0])
    assert tables.rows == [[0, 1], [0, 1]]
    assert refcounts(tables)[:4] == [2, 2, 0, 0]
    assert tables.append(1) == [(1, 2)]  # row 0 copies its partial last block; row 1 keeps the original
    assert tables.rows == [[0, 2], [0, 1]]
    assert refcounts(tables)[:4] == [2, 1, 1, 0]
    assert tables.append(1) == []  # nothing shared is written any more
    assert tables.append(1) == []
    assert tables.rows == [[0, 2, 3], [0, 1, 4]]


def test_copy_on_write_after_crop_into_a_shared_block():
    tables = make_tables(3)
    tables.prefill(8, [0, 0])
    tables.crop(2)  # the shared full block 1 becomes a shared partial last block
    assert (tables.rows, tables.num_tokens) == ([[0, 1], [0, 1]], 6)
    assert tables.append(1) == [(1, 2)]  # one copy fits in the one free block
    assert tables.rows == [[0, 2], [0, 1]]
    assert refcounts(tables) == [2, 1, 1]


def test_copy_on_write_keeps_the_last_writer_on_the_original_per_block():
    tables = make_tables(16)
    tables.prefill(5, [0, 1, 2, 3])
    assert tables.rows == [[0, 1], [2, 3], [4, 5], [6, 7]]
    tables.reorder([3, 1, 1, 3, 1])  # three rows write into block 3, two into block 7
    assert tables.append(2) == [(7, 0), (3, 1), (3, 4)]
    assert tables.rows == [[6, 0], [2, 1], [2, 4], [6, 7], [2, 3]]
    assert refcounts(tables)[:9] == [1, 1, 3, 1, 1, 0, 2, 1, 0]


def test_copy_on_write_together_with_a_new_block():
    tables = make_tables(16)
    tables.prefill(7, [0, 1])
    tables.reorder([1, 1])
    assert tables.rows == [[2, 3], [2, 3]]
    assert tables.append(3) == [(3, 0)]  # copy the partial block, then one new block per row
    assert tables.rows == [[2, 0, 1], [2, 3, 4]]


def test_copy_on_write_needs_only_the_copies_it_makes():
    tables = make_tables(2)
    tables.prefill(2, [0, 1])
    tables.reorder([0, 0])  # block 1 is freed: one free block, enough for the one copy
    assert tables.pool.num_free_blocks == 1
    assert tables.append(1) == [(0, 1)]
    assert tables.rows == [[1], [0]]


def test_copy_on_write_out_of_blocks_changes_nothing():
    tables = make_tables(2)
    tables.prefill(8, [0, 0])
    tables.crop(2)
    before = snapshot(tables)
    with pytest.raises(OutOfBlocksError, match="1 more blocks needed, 0 free of 2"):
        tables.append(1)
    assert snapshot(tables) == before


# --- reorder, crop, unshare, release ------------------------------------------------------------------------------


def test_reorder_moves_references():
    tables = make_tables(8)
    tables.prefill(6, [0, 1, 2])
    tables.reorder([2, 2, 0])
    assert tables.rows == [[4, 5], [4, 5], [0, 1]]
    assert refcounts(tables) == [1, 1, 0, 0, 2, 2, 0, 0]
    tables.reorder([1])  # shrink
    assert tables.rows == [[4, 5]]
    assert refcounts(tables) == [0, 0, 0, 0, 1, 1, 0, 0]
    tables.reorder([0, 0, 0])  # grow
    assert refcounts(tables) == [0, 0, 0, 0, 3, 3, 0, 0]
    assert tables.num_tokens == 6


def test_identity_reorder_is_a_no_op():
    tables = make_tables(8)
    tables.prefill(6, [0, 1])
    before = snapshot(tables)
    tables.reorder([0, 1])
    assert snapshot(tables) == before


def test_reorder_with_a_bad_index_changes_nothing():
    tables = make_tables(8)
    tables.prefill(6, [0, 1])
    before = snapshot(tables)
    with pytest.raises(IndexError):
        tables.reorder([0, 5])
    assert snapshot(tables) == before


def test_crop_frees_whole_blocks_only():
    tables = make_tables(8)
    tables.prefill(10, [0, 1])
    assert tables.rows == [[0, 1, 2], [3, 4, 5]]
    tables.crop(1)  # 9 tokens: every block still holds one
    assert tables.rows == [[0, 1, 2], [3, 4, 5]]
    tables.crop(2)  # 7 tokens
    assert tables.rows == [[0, 1], [3, 4]]
    assert list(tables.pool._free) == [2, 5, 6, 7]
    tables.crop(0)
    assert tables.rows == [[0, 1], [3, 4]]
    tables.crop(100)
    assert (tables.rows, tables.num_tokens, tables.pool.num_used_blocks) == ([[], []], 0, 0)
    assert tables.append(5) == []
    assert tables.rows == [[0, 1], [2, 3]]


def test_crop_of_shared_blocks_drops_one_reference_per_row():
    tables = make_tables(8)
    tables.prefill(9, [0, 0])
    assert tables.rows == [[0, 1, 2], [0, 1, 3]]
    tables.crop(5)
    assert tables.rows == [[0], [0]]
    assert refcounts(tables)[:4] == [2, 0, 0, 0]


def test_unshare_gives_a_row_private_copies():
    tables = make_tables(8)
    tables.prefill(10, [0, 0])
    assert tables.rows == [[0, 1, 2], [0, 1, 3]]
    assert tables.unshare(1) == [(0, 4), (1, 5)]
    assert tables.rows == [[0, 1, 2], [4, 5, 3]]
    assert refcounts(tables)[:6] == [1, 1, 1, 1, 1, 1]
    assert tables.unshare(0) == []


def test_unshare_out_of_blocks_changes_nothing():
    tables = make_tables(5)
    tables.prefill(10, [0, 0])
    before = snapshot(tables)
    with pytest.raises(OutOfBlocksError, match="1 more blocks needed, 1 free of 5"):
        tables.unshare(1)
    assert snapshot(tables) == before


def test_release_frees_everything():
    tables = make_tables(8)
    tables.prefill(10, [0, 0, 2])
    tables.reorder([2, 0, 0, 1])
    tables.release()
    assert (tables.rows, tables.num_tokens, tables.pool.num_used_blocks) == ([], 0, 0)
    assert list(tables.pool._free) == list(range(8))
    tables.prefill(3, [0])
    assert tables.rows == [[0]]


# --- strided layout -----------------------------------------------------------------------------------------------


def test_strided_layout_detection():
    tables = make_tables(16)
    assert tables.strided_layout() is None  # no rows
    tables.prefill(0, [0, 1])
    assert tables.strided_layout() is None  # rows without blocks
    tables.release()
    tables.prefill(6, [0])
    assert tables.strided_layout() == StridedLayout(0, 2)  # one row: its own length
    tables.release()
    tables.prefill(6, [0, 1, 2])
    tables.reorder([1, 2])
    assert tables.rows == [[2, 3], [4, 5]]
    assert tables.strided_layout() == StridedLayout(2, 2)
    tables.reorder([1, 0])
    assert tables.strided_layout() is None  # rows in descending order
    tables.reorder([1, 1])
    assert tables.strided_layout() is None  # shared rows


def test_strided_layout_needs_uniform_stride_and_consecutive_blocks():
    tables = make_tables(16)
    tables.prefill(5, [0, 1, 2], reserve_tokens=9)
    assert tables.rows == [[0, 1], [3, 4], [6, 7]]
    assert tables.strided_layout() == StridedLayout(0, 3)
    tables.reorder([0, 2])
    assert tables.strided_layout() == StridedLayout(0, 6)
    tables.reorder([0, 1, 1])
    tables.unshare(2)  # fresh blocks 1st and 2nd lowest free: not consecutive after row 1
    assert tables.rows == [[0, 1], [6, 7], [2, 3]]
    assert tables.strided_layout() is None


# --- random operation sequences -----------------------------------------------------------------------------------


class TablesMachine(RuleBasedStateMachine):
    """Random prefill / append / reorder / crop / unshare / release on a small pool, next to a model of what every
    row holds. Storage is simulated: each block is a list of token values, copies are applied as returned, and
    every row must read back exactly its own tokens after every step."""

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(0, 16), growable=st.booleans())
    def setup(self, block_size, num_blocks, growable):
        self.tables = BlockTables(BlockPool(num_blocks, growable=growable), block_size)
        self.expected: list[list[int]] = []  # tokens of each row
        self.storage: dict[int, list] = {}
        self.next_token = 0

    # -- helpers

    def fresh_tokens(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def write(self, row_index: int, start: int, is_prefill: bool = False) -> None:
        """Store the row's tokens from `start` on; only a prefill may write (identical tokens) into shared blocks."""
        tables, block_size = self.tables, self.tables.block_size
        row = tables.rows[row_index]
        for t in range(start, tables.num_tokens):
            block = row[t // block_size]
            assert is_prefill or tables.pool.refcount(block) == 1, f"row {row_index} writes into shared block {block}"
            self.storage.setdefault(block, [None] * block_size)[t % block_size] = self.expected[row_index][t]

    def apply_copies(self, copies) -> None:
        for source, destination in copies:
            assert self.tables.pool.refcount(destination) == 1
            self.storage[destination] = list(self.storage[source])

    def attempt(self, operation, *args):
        """Run a table operation; if it runs out of blocks, check that nothing changed and return None."""
        before = snapshot(self.tables)
        try:
            result = operation(*args)
        except OutOfBlocksError:
            assert not self.tables.pool.growable
            assert snapshot(self.tables) == before
            return None
        rows_before, version_before = before[0], before[2]
        if self.tables.rows != rows_before:
            assert self.tables.version != version_before, "rows changed without a version bump"
        return () if result is None else result

    # -- rules

    @precondition(lambda self: self.tables.num_rows == 0)
    @rule(num_tokens=st.integers(0, 9), picks=st.lists(st.integers(0, 4), min_size=1, max_size=4),
          reserve_tokens=st.integers(0, 16))
    def prefill(self, num_tokens, picks, reserve_tokens):
        group_of = []  # row r joins the group of row picks[r] if that is an earlier row, else leads a new group
        for r, pick in enumerate(picks):
            group_of.append(group_of[pick] if pick < r else r)
        if self.attempt(self.tables.prefill, num_tokens, group_of, reserve_tokens) is None:
            return
        prompts = {g: self.fresh_tokens(num_tokens) for g in set(group_of)}
        self.expected = [list(prompts[g]) for g in group_of]
        for r in range(len(group_of)):
            self.write(r, 0, is_prefill=True)
        rows = self.tables.rows
        num_shared = num_tokens // self.tables.block_size if group_of != list(range(len(group_of))) else 0
        for r, g in enumerate(group_of):  # a group shares its full blocks; everything else is private
            assert rows[r][:num_shared] == rows[g][:num_shared]
            assert all(self.tables.pool.refcount(b) == 1 for b in rows[r][num_shared:])

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(num_new=st.integers(0, 9))
    def append(self, num_new):
        old, pool = self.tables.num_tokens, self.tables.pool
        partial_last = {row[-1] for row in self.tables.rows} if old % self.tables.block_size else set()
        num_copies_needed = sum(pool.refcount(b) - 1 for b in partial_last)  # the last writer keeps the original
        copies = self.attempt(self.tables.append, num_new)
        if copies is None:
            return
        assert len(copies) == num_copies_needed
        self.apply_copies(copies)
        for r in range(self.tables.num_rows):
            self.expected[r] += self.fresh_tokens(num_new)
            self.write(r, old)

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(picks=st.lists(st.integers(0, 4), min_size=1, max_size=5))
    def reorder(self, picks):
        source_rows = [p % self.tables.num_rows for p in picks]
        self.attempt(self.tables.reorder, source_rows)
        self.expected = [list(self.expected[i]) for i in source_rows]

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(picks=st.lists(st.integers(0, 4), min_size=1, max_size=5))
    def beam_step(self, picks):
        """What beam search does every token: reorder (with duplicates), then write one token per row."""
        self.reorder(picks)
        self.append(1)

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(num_remove=st.integers(0, 10))
    def crop(self, num_remove):
        self.attempt(self.tables.crop, num_remove)
        for row in self.expected:
            del row[self.tables.num_tokens:]

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(pick=st.integers(0, 4))
    def unshare(self, pick):
        row_index = pick % self.tables.num_rows
        copies = self.attempt(self.tables.unshare, row_index)
        if copies is None:
            return
        self.apply_copies(copies)
        assert all(self.tables.pool.refcount(b) == 1 for b in self.tables.rows[row_index])

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule()
    def release(self):
        self.attempt(self.tables.release)
        self.expected = []
        assert self.tables.pool.num_used_blocks == 0
        assert list(self.tables.pool._free) == list(range(self.tables.pool.num_blocks))

    # -- invariants

    @invariant()
    def refcounts_equal_references(self):
        pool, rows = self.tables.pool, self.tables.rows
        references = [sum(row.count(b) for row in rows) for b in range(pool.num_blocks)]
        assert refcounts(self.tables) == references
        assert all(len(set(row)) == len(row) for row in rows)

    @invariant()
    def free_list_is_exactly_the_unreferenced_blocks(self):
        pool = self.tables.pool
        referenced = {b for row in self.tables.rows for b in row}
        assert list(pool._free) == [b for b in range(pool.num_blocks) if pool.refcount(b) == 0]
        assert not referenced & set(pool._free)
        assert pool.num_used_blocks == len(referenced)

    @invariant()
    def rows_hold_exactly_their_tokens(self):
        tables = self.tables
        for r, row in enumerate(tables.rows):
            assert len(row) == math.ceil(tables.num_tokens / tables.block_size)
            block_size = tables.block_size
            stored = [self.storage[row[t // block_size]][t % block_size] for t in range(tables.num_tokens)]
            assert stored == self.expected[r]

    @invariant()
    def strided_layout_describes_the_rows(self):
        layout = self.tables.strided_layout()
        if layout is not None:
            for r, row in enumerate(self.tables.rows):
                start = layout.first_block + r * layout.row_stride
                assert row == list(range(start, start + len(row)))
            assert layout.row_stride >= len(self.tables.rows[0])

    def teardown(self):
        if hasattr(self, "tables"):
            self.tables.release()
            assert self.tables.pool.num_used_blocks == 0


TablesMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_tables_state_machine = TablesMachine.TestCase
