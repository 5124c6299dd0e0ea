"""Per-row block tables over a `BlockPool`. Plain Python, no torch.

Every row of a batch holds the same number of tokens (generate pads on the left), so one `num_tokens` describes
all rows; row `r` stores token `t` in block `rows[r][t // block_size - first_block]` at offset `t % block_size`.
Tokens before `first_token` are evicted (sliding-window layers): a row's blocks start at `first_block`, the block of
`first_token`, and every block wholly before it is freed.
Rules:
- rows whose prompts are identical share the prompt's full blocks (reference counts), never its partial last block;
- a row about to write into a block with more than one reference first gets a private copy (copy-on-write);
- when no block is shared, rows are laid out at a uniform stride (`StridedLayout`), so a reader can view the pool
  as `[rows, tokens]` without gathering.
Operations that can run out of blocks check the whole need first and raise before changing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import BlockPool, OutOfBlocksError

# (source block, destination block) pairs that the storage must copy, in every layer, before the next write.
BlockCopies = list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class StridedLayout:
    """Row `r` owns blocks `first_block + r * row_stride + j`, for `j < blocks in the row`."""

    first_block: int
    row_stride: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockTables:
    """Block lists of every row, plus the token count they all share.

    Args:
        pool: the allocator the blocks come from.
        block_size: tokens per block.
    """

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.rows: list[list[int]] = []
        self.num_tokens = 0
        self.first_token = 0  # tokens before it are evicted; rows hold blocks from `first_block` on
        self.version = 0  # bumped on every change of `rows`, so readers can rebuild derived tensors lazily
        self._may_write_shared = False  # some row's last block may be shared: `append` must check copy-on-write

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def first_block(self) -> int:
        """Index (in token blocks) of every row's first held block."""
        return self.first_token // self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return _ceil_div(num_tokens, self.block_size)

    def prefill(self, num_tokens: int, group_of: list[int], reserve_tokens: int = 0, first_token: int = 0) -> None:
        """Lay out `len(group_of)` empty rows holding `num_tokens` tokens each, of which tokens from `first_token` on
        are stored (earlier ones are evicted at once: a sliding window's long prompt).

        `group_of[r]` is the first row whose content equals row `r` (`group_of[r] == r` for a group's leader):
        a group shares its full blocks. `reserve_tokens` is how long rows may grow; a row's private blocks are
        placed at a stride that leaves room for it, so the layout stays strided while rows grow.
        """
        assert not self.rows, "prefill on non-empty tables"
        self.first_token = first_token
        num_shared, leaders, num_private, stride = self._prefill_shape(num_tokens, group_of, reserve_tokens)
        self._require(len(leaders) * num_shared + len(group_of) * num_private)
        shared = {g: self.pool.allocate(num_shared) for g in leaders}
        base = self.pool.lowest_free_block
        for r, g in enumerate(group_of):
            if g != r:
                self.pool.share(shared[g])
            hint = None if base is None else base + r * stride
            self.rows.append(shared[g] + self.pool.allocate(num_private, start=hint))
        self.num_tokens = num_tokens
        self._changed()

    def prefill_need(self, num_tokens: int, group_of: list[int], reserve_tokens: int = 0) -> int:
        """Blocks `prefill` would like free: shared prompt blocks plus a full stride per row."""
        num_shared, leaders, _, stride = self._prefill_shape(num_tokens, group_of, reserve_tokens)
        return len(leaders) * num_shared + len(group_of) * stride

    def _prefill_shape(self, num_tokens: int, group_of: list[int],
                       reserve_tokens: int) -> tuple[int, list[int], int, int]:
        shares = any(g != r for r, g in enumerate(group_of))
        num_shared = max(num_tokens // self.block_size - self.first_block, 0) if shares else 0
        leaders = sorted(set(group_of))
        num_private = self.blocks_for(num_tokens) - self.first_block - num_shared
        stride = max(self.blocks_for(max(reserve_tokens, num_tokens)) - self.first_block - num_shared, num_private)
        return num_shared, leaders, num_private, stride

    def append(self, num_new: int) -> BlockCopies:
        """Make room for `num_new` more tokens in every row; returns the copy-on-write copies to perform."""
        old, new = self.num_tokens, self.num_tokens + num_new
        crosses_block = self.blocks_for(new) > self.blocks_for(old)
        if not crosses_block and not self._may_write_shared:
            self.num_tokens = new
            return []
        cow_rows = self._rows_writing_shared(old) if old % self.block_size else []
        num_extra = self.blocks_for(new) - self.blocks_for(old)
        self._require(len(cow_rows) + num_extra * self.num_rows)
        copies = [self._copy_on_write(r) for r in cow_rows]
        for row in self.rows:
            hint = row[-1] + 1 if row else None
            row.extend(self.pool.allocate(num_extra, start=hint))
        self.num_tokens = new
        self._changed()
        return copies

    def reorder(self, source_rows: list[int]) -> None:
        """New row `i` becomes a reference to old row `source_rows[i]` (beam reorder, batch select/repeat)."""
        if source_rows == list(range(self.num_rows)):
            return
        new_rows = [list(self.rows[i]) for i in source_rows]
        for row in new_rows:
            self.pool.share(row)
        for row in self.rows:
            self.pool.free(row)
        self.rows = new_rows
        self._changed()

    def evict_before(self, token: int) -> None:
        """Evict tokens before `token` in every row, freeing the blocks wholly before it."""
        if token <= self.first_token:
            return
        num_freed = token // self.block_size - self.first_block
        self.first_token = token
        if num_freed > 0:
            for row in self.rows:
                self.pool.free(row[:num_freed])
                del row[:num_freed]
            self._changed()

    def crop(self, num_remove: int) -> None:
        """Forget the last `num_remove` tokens of every row, freeing blocks that no longer hold any."""
        assert self.first_token == 0 or self.num_tokens - num_remove >= self.first_token, "crop into evicted tokens"
        self.num_tokens = max(self.num_tokens - num_remove, 0)
        keep = self.blocks_for(self.num_tokens) - self.first_block
        for row in self.rows:
            self.pool.free(reversed(row[keep:]))
            del row[keep:]
        self._changed()

    def unshare(self, row_index: int) -> BlockCopies:
        """Give one row private copies of all its shared blocks (used when rows thought identical differ)."""
        row = self.rows[row_index]
        shared = [j for j, block in enumerate(row) if self.pool.refcount(block) > 1]
        self._require(len(shared))
        copies = []
        for j in shared:
            (fresh,) = self.pool.allocate(1)
            copies.append((row[j], fresh))
            self.pool.free([row[j]])
            row[j] = fresh
        self._changed()
        return copies

    def release(self) -> None:
        """Free every row's blocks."""
        for row in self.rows:
            self.pool.free(reversed(row))
        self.rows, self.num_tokens, self.first_token = [], 0, 0
        self._changed()

    def strided_layout(self) -> StridedLayout | None:
        """The layout if every row's blocks are consecutive and rows start a uniform stride apart, else None."""
        if not self.rows or not self.rows[0]:
            return None
        first, length = self.rows[0][0], len(self.rows[0])
        stride = self.rows[1][0] - first if self.num_rows > 1 else length
        if stride < length:
            return None
        for r, row in enumerate(self.rows):
            start = first + r * stride
            if row != list(range(start, start + length)):
                return None
        return StridedLayout(first, stride)

    def _rows_writing_shared(self, num_tokens: int) -> list[int]:
        # Rows that must copy, in order: each copy drops a reference, so the block's last writer keeps it.
        last = num_tokens // self.block_size - self.first_block
        refs_left: dict[int, int] = {}
        rows = []
        for r, row in enumerate(self.rows):
            refs = refs_left.setdefault(row[last], self.pool.refcount(row[last]))
            if refs > 1:
                rows.append(r)
                refs_left[row[last]] = refs - 1
        return rows

    def _copy_on_write(self, r: int) -> tuple[int, int]:
        last = self.rows[r][-1]
        (fresh,) = self.pool.allocate(1, start=self.rows[r][-2] + 1 if len(self.rows[r]) > 1 else None)
        self.pool.free([last])
        self.rows[r][-1] = fresh
        return last, fresh

    def _require(self, num: int) -> None:
        if not self.pool.can_allocate(num):
            raise OutOfBlocksError(num - self.pool.num_free_blocks, self.pool.num_free_blocks, self.pool.num_blocks)

    def _changed(self) -> None:
        self.version += 1
        self._may_write_shared = any(row and self.pool.refcount(row[-1]) > 1 for row in self.rows)
