"""CUDA graphs of the engine's decode steps (GPU only).

On a GPU the per-token cost of a small model is kernel launches, not arithmetic, so steps where every sequence
computes exactly one token (plain decodes, the bulk of serving) replay a captured CUDA graph, as vLLM does: one graph
per padded batch size (1, 2, 4, 8, 16, then steps of 16 up to `max_num_seqs`), each captured once at engine start
over static input tensors that every replay refills in place. A graph cannot hold a host synchronisation or a shape
that changes, so its attention is `decode_attention`: one query per sequence, the block table padded to the longest
sequence the engine allows, every size fixed, nothing read back to the host. Rows past a step's real sequences decode
token 0 at position 0 into the pool's spare block (`KVPool.spare_block`, never handed out), which nothing reads.
Other steps (prefill chunks, speculative candidates) run eagerly.

This path is written and its attention is tested on CPU against the kernel (tests/test_cuda_graphs.py); the capture
itself runs only where CUDA is, and had not been run on a GPU when it was written (see benchmarks/gpu_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .attention import StepAttention, attend_dense, gather_blocks, query_mask
from .kv_pool import KVPool


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                     value_pool: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                     query_start: torch.Tensor, kv_lengths: torch.Tensor, scale: float, window: int,
                     softcap: float, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's rule (kernels/csrc/paged_attention.cpp) for a step where every sequence computes the same number `n`
    of packed tokens (1 for a decode, 1 + k for a speculative verify), sequence s the tokens `s * n .. s * n + n - 1`:
    `query` `[heads, seqs * n, dim]` -> `[seqs * n, heads, dim]`, with fixed shapes and no host synchronisation
    (capturable in a CUDA graph, traceable whole by the compiler). `query_start` is implied and not read. With
    `tree_mask` `[seqs, n, m]` the n tokens are nodes of a tree of the last m columns (`paged_tree_attention`'s
    rule)."""
    heads, tokens, dim = query.shape
    seqs, kv_heads = block_table.shape[0], key_pool.shape[0]
    num = tokens // seqs
    key_pool.view(kv_heads, -1, dim).index_copy_(1, slots, key)
    value_pool.view(kv_heads, -1, dim).index_copy_(1, slots, value)
    k, v = (gather_blocks(pool, block_table) for pool in (key_pool, value_pool))  # [seqs, kv_heads, columns, dim]
    if tree_mask is None:
        mask = query_mask(kv_lengths, num, k.shape[2], window, heads // kv_heads)
    else:
        mask = tree_query_mask(kv_lengths, tree_mask, k.shape[2], window, heads // kv_heads)
    q = query.view(heads, seqs, num, dim).transpose(0, 1)  # [seqs, heads, n, dim]
    out = attend_dense(q, k, v, mask, scale, softcap or None)  # [seqs, heads, n, dim]
    return out.transpose(1, 2).reshape(tokens, heads, dim)


def tree_query_mask(lengths: torch.Tensor, tree_mask: torch.Tensor, columns: int, window: int,
                    groups: int) -> torch.Tensor:
    """`query_mask` for trees: `[rows, 1, groups * n, columns]` True where node i of row r (at column `lengths[r] - n
    + i`) may attend: the columns before the tree (its last m columns) within `window` of its depth-based position,
    and the tree columns `tree_mask[r, i]` `[n, m]` allows."""
    num = tree_mask.shape[-1]  # m
    base = (lengths - num)[:, None, None]  # [rows, 1, 1] the tree's first column
    cols = torch.arange(columns, device=lengths.device)
    offset = cols - base  # [rows, 1, columns] column relative to the tree
    in_tree = (offset >= 0) & (offset < num)
    queries = tree_mask.shape[1]
    sees = tree_mask.bool().gather(2, offset.clamp(0, num - 1).expand(-1, queries, -1))  # [rows, n, columns]
    before = offset < 0
    if window > 0:
        depth_position = base + tree_mask.sum(-1, keepdim=True) - 1  # [rows, n, 1]
        before = before & (cols > depth_position - window)
    return torch.where(in_tree, sees, before).repeat(1, groups, 1)[:, None]


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes that get a graph: 1, 2, 4, 8, 16, then every 16th, and `max_num_seqs` itself."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [1, size]
    positions: torch.Tensor  # [1, size]
    slots: torch.Tensor  # [size]
    block_table: torch.Tensor  # [size, max_blocks]
    kv_lengths: torch.Tensor  # [size]
    logits: torch.Tensor  # [size, vocab], written by each replay


class DecodeGraphs:
    """Captured decode steps of `model` over `kv` (which must have a spare block), for at most `max_num_seqs`
    sequences of at most `max_model_len` tokens."""

    def __init__(self, model: PreTrainedModel, kv: KVPool, max_num_seqs: int, max_model_len: int):
        if kv.spare_block is None:
            raise ValueError("`kv` needs a spare block for the padded rows of a captured step")
        self.model, self.kv = model, kv
        self.device = next(model.parameters()).device
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.sizes = graph_sizes(max_num_seqs)
        self.graphs: dict[int, _Graph] = {}

    def capture(self) -> None:
        """Capture one graph per size (run each step twice on a side stream first, as CUDA graphs require)."""
        pool = None
        for size in reversed(self.sizes):  # largest first, so the smaller graphs reuse its memory pool
            graph = self._static(size)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(graph)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            with torch.cuda.graph(graph.graph, pool=pool):
                graph.logits = self._forward(graph)
            pool = graph.graph.pool()
            self.graphs[size] = graph

    def run(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            kv_lengths: list[int]) -> torch.Tensor | None:
        """Logits `[seqs, vocab]` fp32 of a step where sequence s computes its token s alone; None when no graph
        is as large (the caller runs the step eagerly)."""
        seqs = len(tokens)
        size = next((n for n in self.sizes if n >= seqs), None)
        if size is None or size not in self.graphs:
            return None
        graph, pad = self.graphs[size], size - seqs
        spare = self.kv.spare_block
        table = [row + [spare] * (self.max_blocks - len(row)) for row in tables] + [[spare] * self.max_blocks] * pad
        for target, values in ((graph.tokens[0], tokens + [0] * pad), (graph.positions[0], positions + [0] * pad),
                               (graph.slots, slots + [spare * self.kv.block_size] * pad), (graph.block_table, table),
                               (graph.kv_lengths, kv_lengths + [1] * pad)):
            target.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        graph.graph.replay()
        return graph.logits[:seqs].float()

    def _static(self, size: int) -> _Graph:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        spare = self.kv.spare_block
        graph = _Graph(torch.cuda.CUDAGraph(), zeros(1, size), zeros(1, size),
                       zeros(size) + spare * self.kv.block_size, zeros(size, self.max_blocks) + spare,
                       zeros(size) + 1, torch.empty(0))
        return graph

    def _forward(self, graph: _Graph) -> torch.Tensor:
        size = graph.slots.shape[0]
        step = StepAttention(self.kv, graph.slots, graph.block_table, torch.arange(size + 1, device=self.device),
                             graph.kv_lengths, decode_attention)
        with torch.inference_mode():
            out = self.model(input_ids=graph.tokens, position_ids=graph.positions, use_cache=False,
                             logits_to_keep=0, hf_accel_step=step)
        return out.logits[0]
