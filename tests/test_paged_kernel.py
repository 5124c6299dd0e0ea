"""The C++ paged decode attention against the gather path it replaces (blocks copied out, sdpa over them): the same
outputs for one and several queries per row, grouped-query heads, sliding windows, soft-capping, fp32 and bf16,
scattered blocks and ragged lengths; registered as a custom op with a fake implementation."""

from __future__ import annotations

import pytest
import torch

from hf_accel.engine.attention import DecodeGroup, _attend, _gather
from hf_accel.engine.paged_kernel import paged_decode_kernel

kernel = paged_decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the paged attention kernel could not be built here")


def reference(q, keys, values, blocks, lengths, block_size, window, softcap, scale):
    group = DecodeGroup(index=torch.zeros(q.shape[0], q.shape[2], dtype=torch.long), blocks=blocks, lengths=lengths)
    k, v = (_gather(pool, blocks) for pool in (keys, values))
    mask = group.mask(block_size, window, q.shape[1] // keys.shape[0])
    return _attend(q, k, v, mask, scale, softcap)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("num_queries", [1, 4])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 30.0)])
def test_kernel_equals_gather_then_sdpa(dtype, atol, heads, kv_heads, num_queries, window, softcap):
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, dim, rows = 4, 32, 32, 5
    keys = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    values = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    lengths = torch.tensor([num_queries, 7, 13, 16, 21])  # ragged, one exactly a query's worth
    blocks = torch.randperm(num_blocks, generator=gen)[: rows * 6].view(rows, 6)  # scattered over the pool
    q = torch.randn(rows, heads, num_queries, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    got = kernel(q, keys, values, blocks, lengths, scale, window or 0, softcap or 0.0)
    expected = reference(q, keys, values, blocks, lengths, block_size, window, softcap, scale)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)


def test_kernel_is_a_custom_op_with_a_fake():
    q = torch.empty(2, 4, 1, 8, device="meta")
    pool = torch.empty(2, 3, 4, 8, device="meta")
    out = torch.ops.hf_accel.paged_decode_attention(q, pool, pool, torch.empty(2, 3, dtype=torch.long, device="meta"),
                                                    torch.empty(2, dtype=torch.long, device="meta"), 0.5, 0, 0.0)
    assert out.shape == q.shape and out.device.type == "meta"


def test_bad_shapes_are_refused():
    q, pool = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 4, 8)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        kernel(q, pool, pool, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="length out of the block table"):
        kernel(torch.randn(2, 4, 1, 8), pool, pool, torch.zeros(2, 1, dtype=torch.long), torch.tensor([5, 1]), 1.0,
               0, 0.0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])  # GQA; every layer sliding; sliding + soft-capping
def test_engine_tokens_equal_with_and_without_the_kernel(arch, monkeypatch):
    from conformance import make_model
    from engine_helpers import random_prompts
    from hf_accel import Engine, SamplingParams
    from hf_accel.engine import model_runner

    model = make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")
    prompts = random_prompts([5, 17, 30, 9], seed=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with_kernel = [out.token_ids for out in Engine(model, block_size=4).generate(prompts, params)]
    monkeypatch.setattr(model_runner, "paged_decode_kernel", lambda: None)  # engines built now gather
    gathered = [out.token_ids for out in Engine(model, block_size=4).generate(prompts, params)]
    assert with_kernel == gathered
