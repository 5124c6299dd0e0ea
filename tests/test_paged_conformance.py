"""PagedCache held to the cache conformance suite: architectures x dtypes x attention x decoding modes."""

import pytest
import torch

import hf_accel
from conformance import ARCHITECTURES, MODES, CacheSpec, make_model


def assert_prompt_blocks_shared(cache: hf_accel.PagedCache, num_prompts: int, prompt_len: int) -> None:
    """Rows generated from one prompt hold that prompt's full blocks once (in the layers that keep every token); the
    sliding layers of a model whose every layer slides hold no more than their window by the end."""
    full = [group for group in cache.groups if group.sliding_window is None]
    for group in full:
        tables, pool = group.tables, group.tables.pool
        num_shared = (tables.num_rows - num_prompts) * (prompt_len // tables.block_size)
        assert num_shared > 0, "prompt shorter than a block: the test does not exercise sharing"
        unshared = tables.num_rows * tables.blocks_for(tables.num_tokens)
        assert pool.num_used_blocks <= unshared - num_shared, (
            f"{pool.num_used_blocks} blocks hold {tables.num_rows} rows of {tables.num_tokens} tokens: "
            f"the {num_prompts} prompts of {prompt_len} tokens are not shared across their rows")
    if not full:
        for group in cache.groups:
            tables = group.tables
            assert tables.first_token > 0, "the test does not run past the window"
            bound = tables.num_rows * (tables.blocks_for(group.sliding_window) + 1)
            used = tables.pool.num_used_blocks
            assert used <= bound, f"{used} blocks: the window is not bounded"


PAGED = CacheSpec("paged", hf_accel.PagedCache, {"cache_implementation": "paged"},
                  check_shared_rows=assert_prompt_blocks_shared)
PAGED_SMALL_BLOCKS = CacheSpec("paged-block4", hf_accel.PagedCache,
                               {"cache_implementation": "paged", "cache_config": {"block_size": 4}},
                               check_shared_rows=assert_prompt_blocks_shared)
PAGED_ZERO_PATCH = CacheSpec("paged-zero-patch", hf_accel.PagedCache,
                             cache_factory=lambda model: hf_accel.PagedCache(model.config),
                             check_shared_rows=assert_prompt_blocks_shared)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

def _cases(spec_dtypes=tuple(DTYPES), archs=tuple(ARCHITECTURES), attns=("sdpa", "eager")):
    return [
        pytest.param(arch, DTYPES[dtype], attn, mode, id=f"{arch}-{dtype}-{attn}-{mode}")
        for arch in archs
        for dtype in spec_dtypes
        for attn in ARCHITECTURES[arch][1] if attn in attns
        for mode in MODES
    ]



# Sliding layers evict as DynamicCache's do, so the attention reduces over the same K/V: exact in bf16 too.
@pytest.mark.parametrize("arch, dtype, attn, mode", _cases())
def test_paged(arch, dtype, attn, mode):
    MODES[mode](make_model(arch, dtype, attn), PAGED)


# Block size 4: many block boundaries, copy-on-write of shared partial blocks, crops across blocks. Covers full,
# all-sliding, and hybrid (sdpa and eager-only) models.
@pytest.mark.parametrize("arch, dtype, attn, mode", _cases(("fp32",), ("llama", "mistral", "qwen2", "gemma2")))
def test_paged_small_blocks(arch, dtype, attn, mode):
    MODES[mode](make_model(arch, dtype, attn), PAGED_SMALL_BLOCKS)


# `past_key_values=PagedCache(model.config)`: generate neither builds nor sizes the cache.
@pytest.mark.parametrize("arch, dtype, attn, mode", _cases(("fp32",), ("llama", "qwen2", "gemma2")))
def test_paged_zero_patch(arch, dtype, attn, mode):
    MODES[mode](make_model(arch, dtype, attn), PAGED_ZERO_PATCH)
