"""Bad input to the paged cache: a clear error naming the argument and what is allowed, through `generate` and through
the `PagedCache` constructor, and no blocks held afterwards. Also what `memory_bytes` / `used_bytes` report."""

import pytest
import torch
from transformers import (
    Lfm2Config,
    Lfm2ForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from tiny_llama import tiny_llama
from hf_accel import OutOfBlocksError, PagedCache, PagedCacheConfig

# Llama below: 2 layers, 2 KV heads of dim 16, fp32 -> one block of 4 tokens is 4 * 2 * 16 * 2 (K, V) * 4 * 2 bytes
BYTES_PER_BLOCK_OF_4 = 2048


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def prompt(rows: int = 1, length: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 128, (rows, length), generator=torch.Generator().manual_seed(seed))


def generate_paged(model, cache_config=None, **kwargs):
    kwargs.setdefault("max_new_tokens", 3)
    return model.generate(prompt(), do_sample=False, cache_implementation="paged", cache_config=cache_config, **kwargs)


# --- models the paged cache cannot serve --------------------------------------------------------------------------


def test_encoder_decoder_model():
    config = T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    model = T5ForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="cache_implementation='paged' supports decoder-only models"):
        generate_paged(model)
    with pytest.raises(ValueError, match="PagedCache supports decoder-only models; `config` is an encoder-decoder"):
        PagedCache(config)


def test_model_without_the_cache_api():
    config = RwkvConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=64,
    )
    model = RwkvForCausalLM(config).eval()
    assert not model._supports_default_dynamic_cache()
    with pytest.raises(ValueError, match="cache_implementation='paged' needs a model that uses transformers' Cache API"):
        generate_paged(model)


def test_model_with_unsupported_layer_types():
    config = Lfm2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )
    model = Lfm2ForCausalLM(config).eval()
    message = r"PagedCache supports layer types \('full_attention', .*\); this model's `config` has \['conv'\]"
    with pytest.raises(ValueError, match=message):
        generate_paged(model)
    with pytest.raises(ValueError, match=message):
        PagedCache(config)


# --- bad settings ----------------------------------------------------------------------------------------------------

BAD_SETTINGS = [
    *[({"block_size": v}, "`block_size` must be a positive int") for v in (0, -1, 1.5, True, "16", None)],
    *[({"num_blocks": v}, "`num_blocks` must be a positive int or None") for v in (0, -2, 1.5, True, "8")],
    *[({"max_memory": v}, "`max_memory` must be positive") for v in (0, -5, "0MiB")],
    *[({"max_memory": v}, "`max_memory` must be an int number of bytes or a string such as '512MiB'")
      for v in (True, "lots", "2 GiBs", 1.5e6, [1])],
    ({"num_blocks": 4, "max_memory": "1MiB"}, "Set at most one of `num_blocks` and `max_memory`"),
]


def _id(case):
    return repr(case[0])


@pytest.mark.parametrize("settings, message", BAD_SETTINGS, ids=[_id(c) for c in BAD_SETTINGS])
def test_bad_settings_via_generate(model, settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        generate_paged(model, cache_config=settings)


@pytest.mark.parametrize("settings, message", BAD_SETTINGS, ids=[_id(c) for c in BAD_SETTINGS])
def test_bad_settings_via_constructor(model, settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        PagedCache(model.config, **settings)
    with pytest.raises((ValueError, TypeError), match=message):
        PagedCacheConfig(**settings)


@pytest.mark.parametrize("settings", [{"block_size": 0}, {"block_size": -1}, {"num_blocks": 0}, {"max_memory": "lots"}])
def test_wrong_values_are_value_errors(settings):
    with pytest.raises(ValueError):
        PagedCacheConfig(**settings)


@pytest.mark.parametrize("cache_config", [16, "block_size=4"])
def test_cache_config_of_the_wrong_type(model, cache_config):
    with pytest.raises(TypeError, match="cache_config"):
        generate_paged(model, cache_config=cache_config)


def test_unknown_cache_config_keys(model):
    message = r"Unknown paged cache_config keys \['blocksize', 'dtype'\]; allowed keys are \['block_size', 'max_memory'"
    with pytest.raises(ValueError, match=message):
        generate_paged(model, cache_config={"blocksize": 4, "dtype": "fp16"})
    with pytest.raises(ValueError, match=message):
        PagedCacheConfig.from_dict({"blocksize": 4, "dtype": "fp16", "block_size": 4})


def test_good_settings_are_accepted(model):
    assert PagedCacheConfig.from_dict(None) == PagedCacheConfig()
    assert PagedCacheConfig(max_memory="2 KiB").max_memory == 2048
    assert PagedCacheConfig(max_memory="1.5MB").max_memory == 1_500_000
    out = generate_paged(model, cache_config={"block_size": 4, "num_blocks": 8}, return_dict_in_generate=True)
    cache = out.past_key_values
    assert (type(cache), cache.tables.block_size, cache.pool.num_blocks) == (PagedCache, 4, 8)


# --- limits reached at run time: nothing held afterwards ---------------------------------------------------------


def test_max_memory_below_one_block(model):
    with pytest.raises(ValueError, match=r"`max_memory` \(100 bytes\) is below one block \(8192 bytes\)"):
        generate_paged(model, cache_config={"max_memory": 100})  # default block_size 16
    cache = PagedCache(model.config, block_size=4, max_memory=BYTES_PER_BLOCK_OF_4 - 1)
    with pytest.raises(ValueError, match=r"`max_memory` \(2047 bytes\) is below one block \(2048 bytes\)"):
        model.generate(prompt(), max_new_tokens=3, past_key_values=cache)
    assert (cache.pool.num_blocks, cache.pool.num_used_blocks, cache.get_seq_length()) == (0, 0, 0)


def test_pool_too_small_for_the_prompt(model):
    # 10 tokens in blocks of 4: 3 blocks, 2 in the pool
    message = r"1 more blocks needed, 2 free of 2 in the pool. Raise `num_blocks` or `max_memory` in cache_config"
    with pytest.raises(OutOfBlocksError, match=message):
        generate_paged(model, cache_config={"num_blocks": 2, "block_size": 4})
    cache = PagedCache(model.config, block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match=message):
        model.generate(prompt(), max_new_tokens=3, past_key_values=cache)
    assert (cache.pool.num_used_blocks, cache.tables.num_rows, cache.get_seq_length()) == (0, 0, 0)
    out = model.generate(prompt(length=5), max_new_tokens=3, past_key_values=cache, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 8)  # the same cache still serves a request that fits
    assert cache.pool.num_used_blocks == 2


def test_pool_too_small_for_the_batch(model):
    cache = PagedCache(model.config, block_size=4, num_blocks=5)
    with pytest.raises(OutOfBlocksError, match="1 more blocks needed, 5 free of 5"):
        model.generate(prompt(rows=2, length=9), max_new_tokens=2, past_key_values=cache)  # 2 rows * 3 blocks
    assert cache.pool.num_used_blocks == 0


def test_pool_runs_out_while_decoding(model):
    cache = PagedCache(model.config, block_size=4, num_blocks=3)
    with pytest.raises(OutOfBlocksError, match="1 more blocks needed, 0 free of 3"):
        model.generate(prompt(length=8), max_new_tokens=10, do_sample=False, past_key_values=cache)
    # the request's blocks stay with the cache that holds its 12 tokens; nothing else is taken
    assert (cache.get_seq_length(), cache.tables.rows, cache.pool.num_used_blocks) == (12, [[0, 1, 2]], 3)
    cache.reset()
    assert (cache.pool.num_used_blocks, cache.get_seq_length()) == (0, 0)


def test_batch_of_another_size_changes_nothing(model):
    out = model.generate(
        prompt(rows=2), max_new_tokens=2, cache_implementation="paged", cache_config={"block_size": 4},
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    rows, used = [list(r) for r in cache.tables.rows], cache.pool.num_used_blocks
    states = torch.zeros(3, 2, 1, 16)
    with pytest.raises(ValueError, match="PagedCache holds 2 rows but got a batch of 3"):
        cache.update(states, states, 0)
    assert (cache.tables.rows, cache.pool.num_used_blocks, cache.get_seq_length()) == (rows, used, 11)


def test_crop_takes_a_non_positive_count(model):
    out = generate_paged(model, cache_config={"block_size": 4}, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="`crop` takes a non-positive number of tokens to remove, got 2"):
        out.past_key_values.crop(2)
    assert out.past_key_values.get_seq_length() == 12


# --- memory accounting --------------------------------------------------------------------------------------------


def test_memory_and_used_bytes_of_a_fixed_pool(model):
    cache = PagedCache(model.config, block_size=4, num_blocks=8)
    assert (cache.memory_bytes(), cache.used_bytes()) == (0, 0)  # storage is allocated on the first forward
    model.generate(prompt(length=10), max_new_tokens=5, do_sample=False, past_key_values=cache)
    assert cache.get_seq_length() == 14  # 4 blocks of 4
    assert cache.memory_bytes() == 8 * BYTES_PER_BLOCK_OF_4
    assert cache.used_bytes() == 4 * BYTES_PER_BLOCK_OF_4
    cache.reset()
    assert (cache.memory_bytes(), cache.used_bytes()) == (8 * BYTES_PER_BLOCK_OF_4, 0)  # the pool stays allocated


def test_memory_bytes_stay_within_max_memory(model):
    cache = PagedCache(model.config, block_size=4, max_memory="9KiB")  # 9216 bytes: 4 whole blocks
    model.generate(prompt(length=6), max_new_tokens=3, do_sample=False, past_key_values=cache)
    assert cache.pool.num_blocks == 4
    assert cache.memory_bytes() == 4 * BYTES_PER_BLOCK_OF_4 <= 9216
    assert cache.used_bytes() == 2 * BYTES_PER_BLOCK_OF_4


def test_used_bytes_count_shared_blocks_once(model):
    def used_bytes(input_ids):
        out = model.generate(
            input_ids, max_new_tokens=1, cache_implementation="paged", cache_config={"block_size": 4},
            return_dict_in_generate=True,
        )
        cache = out.past_key_values
        assert cache.used_bytes() <= cache.memory_bytes()
        return cache.used_bytes()

    same = prompt(length=8).repeat(2, 1)
    different = torch.cat([prompt(length=8, seed=0), prompt(length=8, seed=1)])
    assert used_bytes(same) == 2 * BYTES_PER_BLOCK_OF_4
    assert used_bytes(different) == 4 * BYTES_PER_BLOCK_OF_4
