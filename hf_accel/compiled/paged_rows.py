"""The static paged layout of one compiled `generate` call: every row's blocks reserved up front.

Row `r` owns blocks `r * width .. r * width + width - 1` of a pool of `rows * width` blocks, `width` sized so the
row's prompt and every token it may generate fit (`max_new_tokens`). The block table `[rows, width]` therefore never
changes during the call, and a decode step's slots and lengths follow from the positions alone
(`slot = table[r, p // block_size] * block_size + p % block_size`), which is what lets the whole step run in one
compiled graph with no host-side bookkeeping. With `ring_tokens` (the sink cache: every layer attends at most a
window), each row owns only enough blocks for that many tokens plus one, and its table maps logical block `b` to its
block `b mod R`: a token overwrites one that left every window long ago, and memory stays constant however long the
row grows. Prompts are packed without their left padding: row `r`'s real tokens
sit at positions `0 .. L_r - 1`, the positions transformers gives them (from the padding mask), and attention reads
exactly `L_r + generated` tokens per row, so pads are never stored or read. The pool uses the engine's layout
(`runtime/kv_pool.py`) and is attended in place by the same op (`runtime/attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..cache.block_pool import OutOfBlocksError
from ..cache.kv_shape import KVShape
from ..runtime.attention import StepAttention
from ..runtime.kv_pool import KVPool

MIN_WIDTH = 2  # a 1-wide block table would be specialized by the compiler: one more graph for short generations


@dataclass(slots=True)
class PrefillInputs:
    """The prompts packed into one row: `tokens` / `positions` `[1, total]`, `keep` `[rows]` (each row's last
    packed token: the logits that choose its first new token)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    attention: StepAttention


def unpadded_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real prompt tokens (1-D), its left padding removed."""
    if attention_mask is None:
        return list(input_ids)
    prompts = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
    if min(len(p) for p in prompts) == 0:
        raise ValueError("`attention_mask` has a row with no tokens: every prompt needs at least one")
    return prompts


class PagedRows:
    """Blocks for `len(prompts)` rows of at most `max_tokens` tokens each, in a pool for `model`'s layers.

    Args:
        model: the model whose K/V the pool holds (its config gives the shape; its first parameter the dtype/device).
        prompt_lengths: real (unpadded) prompt tokens per row, each >= 1.
        max_tokens: tokens any row may reach (longest prompt + new tokens).
        block_size: tokens per block.
        num_blocks: the user's fixed pool size, if any: `OutOfBlocksError` when the rows need more.
        ring_tokens: the most tokens of a row any step reads (prompt included), for a ring of blocks; None: keep all.
        config: the config that gives the K/V shape when it is not `model.config` (an EAGLE head's layer config).
    """

    def __init__(self, model: PreTrainedModel | nn.Module, prompt_lengths: list[int], max_tokens: int,
                 block_size: int, num_blocks: int | None = None, ring_tokens: int | None = None,
                 config: PretrainedConfig | None = None):
        self.rows, self.block_size = len(prompt_lengths), block_size
        self.width = max(-(-max_tokens // block_size), MIN_WIDTH)
        # blocks a row owns: all of its logical blocks, or a ring with one block to spare past what a step reads
        owned = self.width if ring_tokens is None else min(-(-ring_tokens // block_size) + 1, self.width)
        needed = self.rows * owned
        if num_blocks is not None and needed > num_blocks:
            raise OutOfBlocksError(needed, num_blocks, num_blocks)
        weight = next(model.parameters())
        shape = KVShape.from_config(config or model.config, caller="compiled generate with a paged cache",
                                    argument="model")
        # a ring also gets a spare block: the scratch target of writes that must not land anywhere (never read)
        self.kv = KVPool(shape, needed, block_size, weight.dtype, weight.device, spare_block=ring_tokens is not None)
        self.device = weight.device
        # block_table: [rows, width], logical block b of row r -> row r's block b mod owned
        columns = torch.arange(self.width, device=self.device) % owned
        self.block_table = torch.arange(self.rows, device=self.device)[:, None] * owned + columns
        self.prompt_lengths = torch.tensor(prompt_lengths, device=self.device)

    def prefill(self, prompts: list[torch.Tensor], attend) -> PrefillInputs:
        """The packed prefill of `prompts` (1-D token tensors, one per row, no padding; a ring holds them whole)."""
        lengths = self.prompt_lengths
        tokens = torch.cat(prompts)[None]
        query_start = torch.zeros(self.rows + 1, dtype=torch.long, device=self.device)
        query_start[1:] = lengths.cumsum(0)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths.tolist()])
        rows = torch.repeat_interleave(torch.arange(self.rows, device=self.device), lengths)
        slots = self.slots(rows, positions)
        attention = StepAttention(self.kv, slots, self.block_table, query_start, lengths, attend)
        return PrefillInputs(tokens, positions[None], query_start[1:] - 1, attention)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool slot of token `positions[i]` of row `rows[i]`."""
        blocks = self.block_table[rows, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


def table_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots of `positions` `[rows, n]` of each row through `block_table` `[rows, width]` -> `[rows, n]`."""
    return block_table.gather(1, positions // block_size) * block_size + positions % block_size


def decode_attention_inputs(kv: KVPool, block_table: torch.Tensor, positions: torch.Tensor, attend,
                            full_window: int = 0) -> StepAttention:
    """A decode step where row `r` computes one token at `positions[r]`: the attention metadata, from tensors only
    (traced into the compiled step); `full_window` > 0 limits the layers without a window of their own."""
    rows = positions.shape[0]
    slots = table_slots(block_table, positions[:, None], kv.block_size)[:, 0]
    query_start = torch.arange(rows + 1, device=positions.device)
    return StepAttention(kv, slots, block_table, query_start, positions + 1, attend, full_window)
