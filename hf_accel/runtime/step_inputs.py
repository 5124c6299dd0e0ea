"""One step's packed inputs as host lists (`StepInputs`): the tokens of several sequences in one row, their positions
and pool slots, each sequence's query start, context length and block table, and the rows whose logits are kept.
`attention()` turns them into the `hf_accel_step` every layer reads (`attention.StepAttention`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .attention import StepAttention
from .kv_pool import KVPool, token_slots


@dataclass(slots=True)
class StepInputs:
    """One step's packed inputs as host lists: `tokens`, `positions` and `slots` per packed token; `query_start`
    (`seqs + 1` offsets), `kv_lengths` and block `tables` per sequence; `keep`, the packed rows whose logits (and
    hidden states) the step returns."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    kv_lengths: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)

    @classmethod
    def packed(cls, tokens: list[int], entries: list[tuple[list[int], range]], block_size: int) -> StepInputs:
        """`tokens` of several sequences packed in order (`entries`: per sequence, its block ids and the consecutive
        positions of its tokens), each sequence's last token kept."""
        inputs = cls(tokens=tokens, positions=[p for _, span in entries for p in span])
        for blocks, span in entries:
            inputs.slots += token_slots(blocks, span.start, span.stop, block_size)
            inputs.query_start.append(inputs.query_start[-1] + len(span))
            inputs.kv_lengths.append(span.stop)
            inputs.tables.append(blocks[: -(-span.stop // block_size)])
            inputs.keep.append(inputs.query_start[-1] - 1)
        return inputs

    def with_table_width(self, width: int) -> StepInputs:
        """The same step with every block table padded to `width` blocks (block 0: never read past a length)."""
        tables = [table + [0] * (width - len(table)) for table in self.tables]
        return StepInputs(self.tokens, self.positions, self.slots, self.query_start, self.kv_lengths, tables, self.keep)

    def keeping_one(self) -> StepInputs:
        """The same step keeping its last token's row where it keeps none (a prompt's chunk whose logits go unused:
        the single-sequence graph is traced with one kept row)."""
        if self.keep:
            return self
        return StepInputs(self.tokens, self.positions, self.slots, self.query_start, self.kv_lengths, self.tables,
                          [len(self.tokens) - 1])

    def padded(self) -> StepInputs:
        """The same step with no size that could be 1 except the token count: an empty sequence (no queries, no
        context) when there is one, block tables at least 2 wide, at least 2 kept rows."""
        tables, query_start, kv_lengths = self.tables, self.query_start, self.kv_lengths
        if len(tables) < 2:
            tables, query_start, kv_lengths = tables + [[]], query_start + [query_start[-1]], kv_lengths + [0]
        keep = self.keep + (self.keep[-1:] or [0]) * (2 - len(self.keep))
        tables = [table + [0] * (2 - len(table)) for table in tables]
        return StepInputs(self.tokens, self.positions, self.slots, query_start, kv_lengths, tables, keep)

    def attention(self, kv: KVPool, attend, device: torch.device) -> StepAttention:
        """The `hf_accel_step` of these inputs over `kv`: slots, block tables padded to one width, query starts and
        context lengths as tensors on `device`."""
        width = max(map(len, self.tables))
        tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        tables = [table + [0] * (width - len(table)) for table in self.tables]
        return StepAttention(kv, tensor(self.slots), tensor(tables), tensor(self.query_start), tensor(self.kv_lengths),
                             attend)
