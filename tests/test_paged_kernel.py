"""The C++ paged attention against the gather path (blocks copied out, sdpa over them): the same K/V writes and
outputs for decodes, speculative candidates and prefill chunks mixed in one call, grouped-query heads, sliding
windows, soft-capping, fp32 and bf16, scattered blocks and ragged lengths; registered as a custom op that mutates the
pools, with a fake implementation; a build lock left by a killed process does not hang the next one; an edited
header gets its own build."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from hf_accel.runtime.attention import gathered_attention
from hf_accel.kernels import build as kernel_build
from hf_accel.kernels.build import _exclusive, build_directory
from hf_accel.kernels.custom_ops import paged_attention_kernel

kernel = paged_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the paged attention kernel could not be built here")


def step_inputs(dtype, heads, kv_heads, num_queries, lengths, dim=32, block_size=4, num_blocks=128, seed=0):
    """A step's arguments: sequence s computes its last `num_queries[s]` of `lengths[s]` tokens, blocks scattered."""
    gen = torch.Generator().manual_seed(seed)
    seqs, width = len(lengths), -(-max(lengths) // block_size)
    pools = [torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype) for _ in range(2)]
    table = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width)
    slots = torch.cat([table[s, torch.arange(n - q, n) // block_size] * block_size + torch.arange(n - q, n) % block_size
                       for s, (q, n) in enumerate(zip(num_queries, lengths))])
    tokens = sum(num_queries)
    # as the model hands them over: [heads, tokens, dim] views of [tokens, heads, dim]
    query, key, value = (torch.randn(tokens, h, dim, generator=gen).to(dtype).transpose(0, 1)
                         for h in (heads, kv_heads, kv_heads))
    query_start = torch.tensor([0, *torch.tensor(num_queries).cumsum(0).tolist()])
    return [query, key, value, *pools, slots, table, query_start, torch.tensor(lengths), dim**-0.5]


def run(attend, inputs, window, softcap):
    inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    return attend(*inputs, window, softcap), inputs[3], inputs[4]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (5, 0.0), (0, 30.0)])
@pytest.mark.parametrize("block_size, dim", [(4, 32), (16, 64), (16, 40), (8, 128)])  # 64, 128: register-held rows
def test_kernel_equals_gather_then_sdpa(dtype, atol, heads, kv_heads, window, softcap, block_size, dim):
    # decodes (one query), speculating decodes (3; 5, whose grouped heads make 20 query rows: the transposed-key
    # path), a prefill chunk from 0 and one resumed mid-sequence (both longer than the kernel's 32-query task), a
    # decode exactly as long as its queries
    num_queries, lengths = [1, 3, 40, 37, 1, 1, 5], [7, 13, 40, 50, 21, 1, 29]
    inputs = step_inputs(dtype, heads, kv_heads, num_queries, lengths, dim=dim, block_size=block_size)
    got, got_keys, got_values = run(kernel, inputs, window, softcap)
    expected, keys, values = run(gathered_attention, inputs, window, softcap)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)  # the same writes, bit for bit
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)


def test_kernel_reads_strided_queries_and_writes_contiguous_output():
    inputs = step_inputs(torch.float32, 4, 2, [2, 5], [9, 5])
    assert not inputs[0].is_contiguous()
    got, _, _ = run(kernel, inputs, 0, 0.0)
    contiguous, _, _ = run(kernel, [inputs[0].contiguous(), *inputs[1:]], 0, 0.0)
    assert got.is_contiguous() and got.shape == (7, 4, 32)
    torch.testing.assert_close(got, contiguous, atol=0, rtol=0)


def test_kernel_is_a_custom_op_that_mutates_the_pools_with_a_fake():
    schema = torch.ops.hf_accel.paged_attention.default._schema
    assert [arg.name for arg in schema.arguments if arg.alias_info and arg.alias_info.is_write] == ["key_pool",
                                                                                                    "value_pool"]
    meta = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in step_inputs(torch.float32, 4, 2, [1, 2], [3, 4])]
    out = torch.ops.hf_accel.paged_attention(*meta, 0, 0.0)
    assert out.shape == (3, 4, 32) and out.device.type == "meta"


def test_bad_shapes_are_refused():
    inputs = step_inputs(torch.float32, 4, 2, [1, 2], [3, 4])
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        kernel(torch.randn(3, 3, 32).transpose(0, 1), *inputs[1:], 0, 0.0)
    with pytest.raises(RuntimeError, match="length out of the block table"):
        kernel(*inputs[:8], torch.tensor([3, 400]), inputs[9], 0, 0.0)
    with pytest.raises(RuntimeError, match="slot out of pool"):
        kernel(*inputs[:5], torch.tensor([0, 1, 10**6]), *inputs[6:], 0, 0.0)
    with pytest.raises(RuntimeError, match="block id out of pool"):
        kernel(*inputs[:6], inputs[6] + 1000, *inputs[7:], 0, 0.0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])  # GQA; every layer sliding; sliding + soft-capping
def test_engine_tokens_equal_with_and_without_the_kernel(arch, monkeypatch):
    from conformance import make_model
    from engine_helpers import random_prompts
    from hf_accel import Engine, EngineConfig, SamplingParams
    from hf_accel.engine import model_runner

    model = make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")
    prompts = random_prompts([5, 17, 30, 9], seed=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with_kernel = [out.token_ids for out in Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)]
    monkeypatch.setattr(model_runner, "paged_attention_kernel", lambda: None)  # engines built now gather
    gathered = [out.token_ids for out in Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)]
    assert with_kernel == gathered


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_one():
    """torch's build takes a lock file and waits, forever, while one exists; a process killed mid-build leaves it
    behind. The kernel builds under an OS lock instead, so a later process finds that file stale and removes it."""
    build = build_directory()
    stale, os_lock = build / "lock", build.parent / f"{build.name}.lock"
    # under the OS lock, as the kernel's loader holds it: no other process of the suite is loading the kernel (whose
    # torch lock file exists while it loads) when the stale file is written or looked for
    build.mkdir(parents=True, exist_ok=True)  # (the suite's first build may not have run yet)
    with _exclusive(os_lock):
        stale.write_text("")
    try:
        code = "from hf_accel.kernels.custom_ops import paged_attention_kernel; assert paged_attention_kernel()"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
        with _exclusive(os_lock):
            assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_an_edited_header_gets_its_own_build(tmp_path, monkeypatch):
    """The build's folder is named by a hash of csrc/: the headers the sources include count, so an edited kernel
    header is built afresh instead of loading the binary of the code before the edit."""
    for path in kernel_build.CSRC.iterdir():
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(kernel_build, "CSRC", tmp_path)
    before = build_directory()
    header = tmp_path / "attention_tiles.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert build_directory() != before
