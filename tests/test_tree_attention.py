"""Tree verification over the block pool: `torch.ops.hf_accel.paged_tree_attention` (the C++ kernel with a
`[seqs, n, m]` tree mask) and `decode_attention`'s tree rule (a GPU's, fixed shapes) both equal attention computed
naively node by node: each node sees the columns before its tree (within a sliding window measured from its depth)
and its ancestors; grouped-query heads, soft-capping, fp32 and bf16, scattered blocks, ragged lengths; the n nodes
computed may be the last of a tree of m > n columns (a draft head growing a tree level by level)."""

from __future__ import annotations

import pytest
import torch

from hf_accel.runtime.cuda_graphs import decode_attention
from hf_accel.kernels.custom_ops import paged_tree_attention_kernel
from test_paged_kernel import run, step_inputs

kernel = paged_tree_attention_kernel()


def random_trees(seqs: int, num: int, seed: int) -> torch.Tensor:
    """`[seqs, num, num]` bool: node i's ancestors and itself, node 0 the root, each node's parent earlier."""
    gen = torch.Generator().manual_seed(seed)
    masks = torch.zeros(seqs, num, num, dtype=torch.bool)
    for s in range(seqs):
        masks[s, 0, 0] = True
        for i in range(1, num):
            parent = int(torch.randint(0, i, (1,), generator=gen))
            masks[s, i] = masks[s, parent]
            masks[s, i, i] = True
    return masks


def naive(inputs, trees: torch.Tensor, window: int, softcap: float) -> torch.Tensor:
    """Node by node: softmax over the visible columns, read from the pool after the new K/V are written."""
    query, key, value, key_pool, value_pool, slots, table, _, lengths, scale = inputs
    key_pool, value_pool = key_pool.clone(), value_pool.clone()
    heads, tokens, dim = query.shape
    kv_heads, _, block_size, _ = key_pool.shape
    for pool, fresh in ((key_pool, key), (value_pool, value)):
        pool.view(kv_heads, -1, dim)[:, slots] = fresh
    seqs, num, width = trees.shape  # n nodes computed, tree of m columns
    out = torch.empty(tokens, heads, dim)
    for s in range(seqs):
        base = int(lengths[s]) - width
        for i in range(num):
            depth = int(trees[s, i].sum()) - 1
            visible = [c for c in range(base) if window == 0 or c > base + depth - window]
            visible += [base + j for j in range(width) if trees[s, i, j]]
            cols = torch.tensor(visible)
            slot = table[s, cols // block_size] * block_size + cols % block_size
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                k = key_pool.view(kv_heads, -1, dim)[kvh, slot].float()
                v = value_pool.view(kv_heads, -1, dim)[kvh, slot].float()
                scores = (k @ query[h, s * num + i].float()) * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                out[s * num + i, h] = torch.softmax(scores, 0) @ v
    return out


RULES = {"decode_attention": decode_attention, "kernel": kernel}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (12, 0.0), (0, 30.0)])
def test_tree_attention_equals_the_naive_rule(rule, dtype, atol, heads, kv_heads, window, softcap):
    if RULES[rule] is None:
        pytest.skip("the paged attention kernel could not be built here")
    num, lengths = 7, [7, 20, 41, 13]
    trees = random_trees(len(lengths), num, seed=heads + window)
    inputs = step_inputs(dtype, heads, kv_heads, [num] * len(lengths), lengths, dim=32, block_size=8)
    got, keys, values = run(lambda *args: RULES[rule](*args, trees), inputs, window, softcap)
    expected = naive(inputs, trees, window, softcap)
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)
    assert torch.equal(keys.view(kv_heads, -1, 32)[:, inputs[5]], inputs[1])  # the nodes' K/V written in place
    assert torch.equal(values.view(kv_heads, -1, 32)[:, inputs[5]], inputs[2])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("window", [0, 14])
def test_nodes_of_a_wider_tree_see_their_ancestors_in_earlier_columns(rule, window):
    if RULES[rule] is None:
        pytest.skip("the paged attention kernel could not be built here")
    num, width, lengths = 4, 11, [11, 23, 40]
    trees = random_trees(len(lengths), width, seed=window)[:, width - num:]  # the newest nodes' rows: [seqs, n, m]
    inputs = step_inputs(torch.float32, 8, 2, [num] * len(lengths), lengths, dim=32, block_size=8)
    got = run(lambda *args: RULES[rule](*args, trees), inputs, window, 0.0)[0]
    torch.testing.assert_close(got.float(), naive(inputs, trees, window, 0.0), atol=2e-5, rtol=2e-5)


def test_a_chain_tree_is_plain_causal_attention():
    if kernel is None:
        pytest.skip("the paged attention kernel could not be built here")
    from hf_accel.kernels.custom_ops import paged_attention_kernel

    num, lengths = 5, [9, 30]
    chain = torch.ones(num, num, dtype=torch.bool).tril().expand(len(lengths), -1, -1)
    inputs = step_inputs(torch.float32, 8, 2, [num] * len(lengths), lengths, dim=32, block_size=4)
    tree = run(lambda *args: kernel(*args, chain), inputs, 6, 0.0)[0]
    plain = run(paged_attention_kernel(), inputs, 6, 0.0)[0]
    torch.testing.assert_close(tree, plain, atol=1e-6, rtol=1e-6)


def test_bad_tree_masks_are_refused():
    if kernel is None:
        pytest.skip("the paged attention kernel could not be built here")
    inputs = step_inputs(torch.float32, 4, 4, [3, 3], [5, 9])
    with pytest.raises(RuntimeError, match=r"tree_mask must be \[seqs, n, m\]"):
        run(lambda *args: kernel(*args, torch.ones(3, 3, 4, dtype=torch.bool)), inputs, 0, 0.0)
    with pytest.raises(RuntimeError, match="needs m >= n"):
        run(lambda *args: kernel(*args, torch.ones(2, 3, 2, dtype=torch.bool)), inputs, 0, 0.0)
    with pytest.raises(RuntimeError, match="every sequence computes n tree nodes"):
        run(lambda *args: kernel(*args, torch.ones(2, 2, 2, dtype=torch.bool)), inputs, 0, 0.0)
    with pytest.raises(RuntimeError, match="holds the tree's m columns"):
        run(lambda *args: kernel(*args, torch.ones(2, 3, 6, dtype=torch.bool)), inputs, 0, 0.0)
    with pytest.raises(RuntimeError, match="a window must be longer than the tree"):
        run(lambda *args: kernel(*args, torch.ones(2, 3, 3, dtype=torch.bool)), inputs, 3, 0.0)
