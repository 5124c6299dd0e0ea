"""PagedCache on sliding-window layers: blocks that leave the window are freed (Mistral: every layer slides; Gemma:
hybrid), the pool stays bounded by the window while tokens equal DynamicCache's, and crops that would need evicted
tokens raise a ValueError saying so."""

import pytest
import torch

import hf_accel
from conformance import SLIDING_WINDOW, make_model, make_prompts


def _generate(model, inputs, new_tokens, **kwargs):
    return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, return_dict_in_generate=True, **kwargs)


def _sliding_groups(cache: hf_accel.PagedCache):
    return [group for group in cache.groups if group.sliding_window is not None]


@pytest.mark.parametrize("arch, attn", [("mistral", "sdpa"), ("gemma2", "eager")])
@pytest.mark.parametrize("prompt_len", [4, 4 * SLIDING_WINDOW])  # short prompt; a prompt already 4x the window
def test_sliding_layers_hold_only_their_window(arch, attn, prompt_len):
    model, inputs = make_model(arch, torch.float32, attn), make_prompts([prompt_len, prompt_len - 2], seed=31)
    new_tokens = 4 * SLIDING_WINDOW  # to 4x the window and beyond
    reference = _generate(model, inputs, new_tokens)
    out = _generate(model, inputs, new_tokens, cache_implementation="paged", cache_config={"block_size": 4})
    assert torch.equal(out.sequences, reference.sequences)
    (group,) = _sliding_groups(out.past_key_values)
    tables, pool = group.tables, group.tables.pool
    window_blocks = tables.blocks_for(SLIDING_WINDOW) + 1  # the window plus the step, unaligned
    assert tables.first_token == tables.num_tokens - SLIDING_WINDOW + 1 - 1  # evicted lazily at the last step's start
    assert pool.num_used_blocks <= tables.num_rows * window_blocks
    assert pool.num_blocks <= tables.num_rows * window_blocks, f"pool of {pool.num_blocks} blocks grew past the window"


def test_sliding_memory_is_a_quarter_of_full_at_four_windows():
    model, inputs = make_model("mistral", torch.float32, "sdpa"), make_prompts([4], seed=32)
    out = _generate(model, inputs, 4 * SLIDING_WINDOW - 4, cache_implementation="paged", cache_config={"block_size": 4})
    cache = out.past_key_values
    per_token = 2 * 2 * 16 * 4 * len(cache.layers)  # K and V, 2 kv heads, head_dim 16, fp32, every layer
    assert cache.memory_bytes() == 3 * 4 * per_token  # blocks_for(8) + 1 blocks of 4 tokens, not 32 tokens


def test_crop_into_evicted_tokens_raises():
    model = make_model("mistral", torch.float32, "sdpa")
    cache = hf_accel.PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(**make_prompts([20], seed=33), past_key_values=cache)  # a long step keeps only the window
    cache.crop(0)
    with pytest.raises(ValueError, match=r"Cannot crop 2 tokens .* tokens before 13 are evicted"):
        cache.crop(-2)
    assert cache.get_seq_length() == 20 and cache.layers[0].keys.shape[2] == SLIDING_WINDOW - 1


def test_decode_reads_full_layers_as_a_view_of_the_pool_and_keys_are_gathered_on_access():
    model = make_model("gemma2", torch.float32, "eager")  # layer 0 sliding, layer 1 full attention
    cache = hf_accel.PagedCache(model.config, block_size=4, max_cache_len=64)
    states = torch.randn(2, 2, 10, 16)
    for index in range(2):
        cache.update(states, states, index)
    step = torch.randn(2, 2, 1, 16)
    cache.update(step, step, 0)
    keys, _ = cache.update(step, step, 1)
    full = cache.layers[1]
    assert keys.untyped_storage().data_ptr() == full.key_pool.untyped_storage().data_ptr()  # zero-copy
    assert torch.equal(full.keys, torch.cat([states, step], dim=2))  # standard shape, gathered into new memory
    assert full.keys.untyped_storage().data_ptr() != full.key_pool.untyped_storage().data_ptr()
    assert cache.layers[0].keys.shape == (2, 2, SLIDING_WINDOW - 1, 16)
