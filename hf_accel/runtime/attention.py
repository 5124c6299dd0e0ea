"""Attention over a block pool (the engine's, compiled generate's), registered with transformers' `AttentionInterface`
as `ATTENTION_NAME` (by `hf_accel.register`).

One engine step runs the model once on all scheduled tokens packed into one row (`[1, num_tokens]`, per-token
`position_ids`). For each layer the registered function makes one call that writes the step's new K/V into their slots
and attends every sequence's queries (a decode's one, a speculating decode's last token and candidates, a prefill
chunk's many; causal, sliding windows and soft-capping as the layer asks) over that sequence's blocks: the C++ kernel of
`kernels/custom_ops.py`, which reads the pool in place, or, where it cannot be built, `gathered_attention` (the blocks
copied out, sdpa over them). The step's metadata (slots, block table, query starts, lengths: tensors only) travels in
the forward's kwargs as `hf_accel_step` (the way transformers' own continuous batching passes `cu_seq_lens`), so no
model code is forked, no state hides in globals, and a compiled model step sees the attention as one opaque op.
Grouped-query heads are folded into the query axis (no K/V repeat).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_pool import KVPool

ATTENTION_NAME = "hf_accel_paged"


@dataclass(slots=True)
class StepAttention:
    """What every layer needs to know about one engine step (the `hf_accel_step` forward kwarg): `seqs` sequences
    whose queries are packed back to back."""

    kv: KVPool
    slots: torch.Tensor  # [num_tokens] pool slot of each packed token
    block_table: torch.Tensor  # [seqs, max_blocks] pool block of each logical block (padded with block 0)
    query_start: torch.Tensor  # [seqs + 1] sequence s owns packed tokens query_start[s] .. query_start[s + 1]
    kv_lengths: torch.Tensor  # [seqs] tokens sequence s attends over, its queries the last of them
    attend: Callable[..., torch.Tensor]  # `kernels.custom_ops`' op or `gathered_attention` (same signature)
    full_window: int = 0  # > 0: the window of layers that have none of their own (compiled generate's sink cache)
    # [seqs, n, m] bool: each sequence computes n nodes of a speculative tree of its last m columns (node i sees tree
    # column j), and `attend` takes it as a last argument (`paged_tree_attention_kernel()`, `decode_attention`)
    tree_mask: torch.Tensor | None = None


def pool_attention(name: str, where: str, step_kwarg: str) -> Callable[[Callable[..., torch.Tensor]], Callable]:
    """Decorator making `body` a function transformers' `AttentionInterface` calls.

    transformers calls `(module, query, key, value, attention_mask, scaling=, dropout=, sliding_window=, softcap=,
    **kwargs) -> (out, None)`; `body(layer, query, key, value, scale, sliding_window, softcap, step, **kwargs) -> out`
    gets the module's `layer_idx`, `scaling` or else 1 / sqrt(head_dim), and `step`, the forward kwarg `step_kwarg`
    (what one step of hf_accel's attention over a pool reads; `ValueError` when it is missing: the implementation
    `name` runs only inside `where`); `kwargs` are the forward's other kwargs (`position_ids` and the like).
    """

    def wrap(body: Callable[..., torch.Tensor]) -> Callable:
        @functools.wraps(body)
        def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
            step = kwargs.pop(step_kwarg, None)
            if step is None:
                raise ValueError(f"attention implementation {name!r} runs only inside {where}")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return body(module.layer_idx, query, key, value, scale, sliding_window, softcap, step, **kwargs), None

        return attention

    return wrap


@pool_attention(ATTENTION_NAME, "hf_accel.Engine steps", "hf_accel_step")
def paged_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    sliding_window: int | None, softcap: float | None, step: StepAttention, **kwargs) -> torch.Tensor:
    """`query` `[1, heads, num_tokens, head_dim]`, `key` / `value` `[1, kv_heads, num_tokens, head_dim]` (the step's
    new tokens) -> `[1, num_tokens, heads, head_dim]`."""
    keys, values = step.kv.keys[layer], step.kv.values[layer]  # [kv_heads, num_blocks, block_size, head_dim]
    args = (query[0].to(keys.dtype), key[0].to(keys.dtype), value[0].to(keys.dtype), keys, values, step.slots,
            step.block_table, step.query_start, step.kv_lengths, scale, sliding_window or step.full_window,
            softcap or 0.0)
    out = step.attend(*args) if step.tree_mask is None else step.attend(*args, step.tree_mask)
    return out[None].to(query.dtype)


def gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                       value_pool: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                       query_start: torch.Tensor, kv_lengths: torch.Tensor, scale: float, window: int,
                       softcap: float) -> torch.Tensor:
    """The kernel's rule (see kernels/csrc/paged_attention.cpp for the shapes) with the blocks copied out of the pool:
    `query` `[heads, tokens, dim]` -> `[tokens, heads, dim]`. Sequences with the same query count attend in one batched
    call."""
    heads, tokens, dim = query.shape
    kv_heads = key_pool.shape[0]
    key_pool.view(kv_heads, -1, dim).index_copy_(1, slots, key)
    value_pool.view(kv_heads, -1, dim).index_copy_(1, slots, value)
    out = query.new_empty(tokens, heads, dim)
    num_queries = query_start[1:] - query_start[:-1]
    for num in num_queries.unique().tolist():
        rows = (num_queries == num).nonzero()[:, 0]
        index = query_start[rows, None] + torch.arange(num, device=query.device)  # [rows, num] packed tokens
        q = query[:, index].transpose(0, 1)  # [rows, heads, num, dim]
        k, v = (gather_blocks(pool, block_table[rows]) for pool in (key_pool, value_pool))
        mask = query_mask(kv_lengths[rows], num, k.shape[2], window, heads // kv_heads)
        attended = attend_dense(q, k, v, mask, scale, softcap or None)  # [rows, heads, num, dim]
        out[index.reshape(-1)] = attended.transpose(1, 2).reshape(-1, heads, dim)
    return out


def query_mask(lengths: torch.Tensor, num: int, columns: int, window: int, groups: int) -> torch.Tensor:
    """`[rows, 1, groups * num, columns]` True where a query may attend: query i of row r sits at position
    `lengths[r] - num + i`; causal, and within `window` (> 0) by transformers' sliding rule."""
    positions = (lengths[:, None] - num + torch.arange(num, device=lengths.device))[:, :, None]  # [rows, num, 1]
    cols = torch.arange(columns, device=lengths.device)
    mask = cols <= positions
    if window > 0:  # key position > query position - window
        mask &= cols > positions - window
    return mask.repeat(1, groups, 1)[:, None]  # folded query rows are (group, position)


def gather_blocks(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`pool` `[kv_heads, num_blocks, block_size, dim]`, `blocks` `[rows, n]` -> `[rows, kv_heads, n * block_size,
    dim]`, each (row, head) slab contiguous."""
    heads, _, size, dim = pool.shape
    rows, n = blocks.shape
    return pool.index_select(1, blocks.reshape(-1)).view(heads, rows, n * size, dim).transpose(0, 1)


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """`q` `[b, heads, q_len, d]`, `k` / `v` `[b, kv_heads, kv_len, d]` -> `[b, heads, q_len, d]`. Query heads sharing
    a K/V head are folded into the query axis (no K/V repeat), so `mask` is given for the folded rows: broadcastable to
    `[b, 1, groups * q_len, kv_len]`."""
    batch, heads, q_len, dim = q.shape
    q = q.reshape(batch, k.shape[1], heads // k.shape[1] * q_len, dim)  # head h uses kv head h // groups
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        out = _eager(q, k, v, mask, scale, softcap)
    return out.reshape(batch, heads, q_len, dim)


def _eager(q, k, v, mask, scale, softcap) -> torch.Tensor:
    # scores: [b, kv_heads, groups * q_len, kv_len], tanh soft-capped as Gemma 2 does
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
