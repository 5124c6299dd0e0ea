"""Attention over the engine's block pool, registered with transformers' `AttentionInterface`.

One engine step runs the model once on all scheduled tokens packed into one row (`[1, num_tokens]`, per-token
`position_ids`). For each layer, the registered function writes the step's new K/V into their slots, then attends
per sequence: decoding sequences in groups of equal query count, each group at once (one query each for plain
decodes, the last token plus its candidates for speculating ones; K/V gathered from their slots, padded and masked),
then each prefill chunk on its own (causal from its first position). Decode groups read the pool in place through the
C++ kernel of `paged_kernel.py` when the runner has it (`StepAttention.decode_kernel`; else their blocks are gathered
into a padded tensor for sdpa); prefill chunks gather theirs (one copy per chunk, then sdpa's matmuls). The metadata travels in the forward's
kwargs as `hf_accel_step` (the way transformers' own continuous batching passes `cu_seq_lens`), so no model code
is forked and no state hides in globals. Grouped-query heads are folded into the query axis (no K/V repeat).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kv_pool import KVPool

ATTENTION_NAME = "hf_accel_paged"


@dataclass(slots=True)
class PrefillRow:
    """A chunk of `num_tokens` queries starting at packed index `start`, at positions `first_position ...`; it
    attends over the first `first_position + num_tokens` tokens of its blocks `kv_blocks` (`[num_blocks]` ids)."""

    start: int
    num_tokens: int
    first_position: int
    kv_blocks: torch.Tensor

    @property
    def kv_length(self) -> int:
        return self.first_position + self.num_tokens


@dataclass(slots=True)
class DecodeGroup:
    """Sequences that each compute their last `num_queries` tokens this step, attended in one batched call: queries
    `index` `[rows, num_queries]` (packed indices), blocks `blocks` `[rows, max_blocks]` (padded), and `lengths`
    `[rows]` tokens each row attends over (its queries included), so query i of row r sits at position
    `lengths[r] - num_queries + i`."""

    index: torch.Tensor
    blocks: torch.Tensor
    lengths: torch.Tensor
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    @property
    def num_queries(self) -> int:
        return self.index.shape[1]

    def mask(self, block_size: int, window: int | None, groups: int) -> torch.Tensor:
        """`[rows, 1, groups * num_queries, max_blocks * block_size]` (one query: `[rows, 1, 1, ...]`, broadcast over
        the folded heads) True where a query may attend: causal, within `window` if any. Built once per step."""
        key = (window, groups)
        if key not in self._masks:
            columns = torch.arange(self.blocks.shape[1] * block_size, device=self.blocks.device)
            offsets = torch.arange(self.num_queries, device=self.blocks.device) - self.num_queries + 1
            positions = (self.lengths[:, None] - 1 + offsets)[:, :, None]  # [rows, num_queries, 1]
            mask = columns <= positions
            if window is not None:  # transformers' sliding rule: key position > query position - window
                mask &= columns > positions - window
            self._masks[key] = mask[:, None] if self.num_queries == 1 else mask.repeat(1, groups, 1)[:, None]
        return self._masks[key]


@dataclass(slots=True)
class StepAttention:
    """What every layer needs to know about one engine step (the `hf_accel_step` forward kwarg)."""

    kv: KVPool
    write_slots: torch.Tensor  # [num_tokens] slot of each packed token
    decodes: list[DecodeGroup]
    prefills: list[PrefillRow]
    decode_kernel: Callable[..., torch.Tensor] | None = None  # `paged_kernel`'s in-place op; None: gather
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def prefill_mask(self, i: int, window: int | None, groups: int, softcap: float | None) -> torch.Tensor | None:
        """`[groups * num_tokens, kv_len]` True where chunk `i`'s queries may attend, rows repeated for the `groups`
        query heads folded onto each K/V head (see `_attend`); None when sdpa's own causal mask is exact (a chunk from
        position 0, no window, no folding, no soft-capping). Built once per step, shared by every layer."""
        row = self.prefills[i]
        if row.first_position == 0 and window is None and groups == 1 and softcap is None:
            return None
        key = ("prefill", i, window, groups)
        if key not in self._masks:
            device = row.kv_blocks.device
            queries = torch.arange(row.first_position, row.kv_length, device=device)[:, None]
            columns = torch.arange(row.kv_length, device=device)
            mask = columns <= queries
            if window is not None:
                mask &= columns > queries - window
            self._masks[key] = mask.repeat(groups, 1)  # folded query rows are (group, position)
        return self._masks[key]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    hf_accel_step: StepAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`query` `[1, heads, num_tokens, head_dim]`, `key` / `value` `[1, kv_heads, num_tokens, head_dim]` (the step's
    new tokens) -> `[1, num_tokens, heads, head_dim]`."""
    if hf_accel_step is None:
        raise ValueError(f"attention implementation {ATTENTION_NAME!r} runs only inside hf_accel.Engine steps")
    step, layer = hf_accel_step, module.layer_idx
    keys, values = step.kv.keys[layer], step.kv.values[layer]  # [kv_heads, num_blocks, block_size, head_dim]
    heads, blocks, size, dim = keys.shape
    keys.view(heads, -1, dim).index_copy_(1, step.write_slots, key[0].to(keys.dtype))
    values.view(heads, -1, dim).index_copy_(1, step.write_slots, value[0].to(values.dtype))
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [num_tokens, heads, head_dim]
    for group in step.decodes:
        flat = group.index.reshape(-1)
        out[flat] = _attend_decodes(step, group, query, keys, values, scaling, sliding_window, softcap)
    for i, row in enumerate(step.prefills):
        q = query[:, :, row.start : row.start + row.num_tokens]  # [1, heads, num_tokens, head_dim]
        k, v = (_gather(pool, row.kv_blocks[None])[:, :, : row.kv_length] for pool in (keys, values))
        mask = step.prefill_mask(i, sliding_window, query.shape[1] // keys.shape[0], softcap)
        out[row.start : row.start + row.num_tokens] = _attend(q, k, v, mask, scaling, softcap)[0].transpose(0, 1)
    return out[None], None


def _attend_decodes(step: StepAttention, group: DecodeGroup, query: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, scaling: float | None, window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """One decode group's attention, `[rows * num_queries, heads, head_dim]`: in place through the step's kernel,
    else over its blocks gathered into a padded tensor."""
    rows, num = group.index.shape
    heads, dim = query.shape[1], query.shape[3]
    q = query[0][:, group.index.reshape(-1)].view(heads, rows, num, dim).transpose(0, 1)  # [rows, heads, num, dim]
    if step.decode_kernel is not None:
        scale = scaling if scaling is not None else dim**-0.5
        attended = step.decode_kernel(q.to(keys.dtype), keys, values, group.blocks, group.lengths, scale,
                                      window or 0, softcap or 0.0).to(query.dtype)
    else:
        k, v = (_gather(pool, group.blocks) for pool in (keys, values))  # [rows, kv_heads, len, dim]
        attended = _attend(q, k, v, group.mask(keys.shape[2], window, heads // keys.shape[0]), scaling, softcap)
    return attended.transpose(1, 2).reshape(rows * num, heads, dim)


def _gather(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`pool` `[kv_heads, num_blocks, block_size, dim]`, `blocks` `[rows, n]` -> `[rows, kv_heads, n * block_size,
    dim]`, each (row, head) slab contiguous."""
    heads, _, size, dim = pool.shape
    rows, n = blocks.shape
    return pool.index_select(1, blocks.reshape(-1)).view(heads, rows, n * size, dim).transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
            softcap: float | None) -> torch.Tensor:
    """`q` `[b, heads, q_len, d]`, `k` / `v` `[b, kv_heads, kv_len, d]` -> `[b, heads, q_len, d]`. Query heads sharing
    a K/V head are folded into the query axis (no K/V repeat), so `mask` is given for the folded rows: broadcastable to
    `[b, 1, groups * q_len, kv_len]`, or None for plain causal attention."""
    batch, heads, q_len, dim = q.shape
    q = q.reshape(batch, k.shape[1], heads // k.shape[1] * q_len, dim)  # head h uses kv head h // groups
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        out = _eager(q, k, v, mask, scale, softcap)
    return out.reshape(batch, heads, q_len, dim)


def _eager(q, k, v, mask, scale, softcap) -> torch.Tensor:
    # scores: [b, kv_heads, groups * q_len, kv_len], tanh soft-capped as Gemma 2 does
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


def register_attention() -> None:
    """Make `ATTENTION_NAME` selectable as an attention implementation (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
