"""`Engine(model, tokenizer, config=EngineConfig(...), speculative=SpeculativeConfig(...))` is the one way to configure
the engine; the keywords of the release before (the limits, `medusa_heads=` with its two speculative keywords) still
build the same engine, with a DeprecationWarning that says what to write instead. Mixing the two ways, or keywords
that do not go together, is refused."""

import functools
import warnings

import pytest
import torch

from conformance import make_model
from engine_helpers import random_prompts
from hf_accel import Engine, EngineConfig, MedusaHeads, SamplingParams, SpeculativeConfig


@functools.lru_cache(maxsize=None)
def tiny() -> torch.nn.Module:
    return make_model("llama", torch.float32, "sdpa")


def heads_for(model: torch.nn.Module) -> MedusaHeads:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return MedusaHeads.for_model(model, num_heads=2, init_from_lm_head=False).eval()


def test_the_new_form_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine(tiny(), config=EngineConfig(max_num_seqs=4, block_size=4),
                        speculative=SpeculativeConfig("ngram"))
    assert engine.config == EngineConfig(max_num_seqs=4, block_size=4)


def test_deprecated_limits_warn_and_build_the_same_engine():
    model, prompts = tiny(), random_prompts([5, 9], seed=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64, kv_cache_memory="64KiB", block_size=4,
                          enable_prefix_caching=False, max_model_len=48, enforce_eager=True)
    new = Engine(model, config=config)
    with pytest.warns(DeprecationWarning, match=r"write Engine\(model, tokenizer, config=hf_accel\.EngineConfig\("
                                                r"max_num_seqs=3, max_num_batched_tokens=64, kv_cache_memory='64KiB', "
                                                r"block_size=4, enable_prefix_caching=False, max_model_len=48, "
                                                r"enforce_eager=True\)\)"):
        old = Engine(model, max_num_seqs=3, max_num_batched_tokens=64, kv_cache_memory="64KiB", block_size=4,
                     enable_prefix_caching=False, max_model_len=48, enforce_eager=True)
    assert old.config == new.config == config and old.speculative is None
    assert old.core.blocks.num_blocks == new.core.blocks.num_blocks and old.max_model_len == new.max_model_len == 48
    assert [o.token_ids for o in old.generate(prompts, params)] == [o.token_ids for o in new.generate(prompts, params)]


def test_deprecated_medusa_keywords_warn_and_build_the_same_engine():
    model, prompts = tiny(), random_prompts([5, 9], seed=2)
    heads = heads_for(model)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with pytest.warns(DeprecationWarning, match=r"speculative=hf_accel\.SpeculativeConfig\(method='medusa', "
                                                r"model=medusa_heads, num_speculative_tokens=1, "
                                                r"max_speculative_batch_tokens=8\)"):
        old = Engine(model, medusa_heads=heads, num_speculative_tokens=1, max_speculative_batch_tokens=8)
    assert old.speculative == SpeculativeConfig("medusa", 1, heads, max_speculative_batch_tokens=8)
    assert old.config == EngineConfig()
    new = Engine(model, speculative=SpeculativeConfig("medusa", model=heads, num_speculative_tokens=1,
                                                      max_speculative_batch_tokens=8))
    assert [o.token_ids for o in old.generate(prompts, params)] == [o.token_ids for o in new.generate(prompts, params)]
    assert old.stats().spec_decode_num_drafts == new.stats().spec_decode_num_drafts > 0


def test_config_with_an_old_keyword_is_a_type_error():
    model = tiny()
    with pytest.raises(TypeError, match="either `config` or the deprecated keywords \\(block_size\\)"):
        Engine(model, config=EngineConfig(), block_size=4)
    with pytest.raises(TypeError, match="either `config` or the deprecated keywords \\(medusa_heads\\)"):
        Engine(model, config=EngineConfig(), medusa_heads=heads_for(model))
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        Engine(model, max_num_seq=4)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(model, config={"max_num_seqs": 4})
    with pytest.raises(TypeError, match="positional"):
        EngineConfig(4)


def test_engine_refuses_mixed_speculation_keywords():
    model = tiny()
    heads = MedusaHeads.for_model(model, num_heads=2)
    with pytest.raises(ValueError, match="either `speculative` or `medusa_heads`"):
        Engine(model, speculative=SpeculativeConfig("ngram"), medusa_heads=heads)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(model, speculative=SpeculativeConfig("ngram"), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="max_speculative_batch_tokens"):
        Engine(model, max_speculative_batch_tokens=8)
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        Engine(model, speculative={"method": "ngram"})
    with pytest.raises(TypeError, match="medusa_heads"):
        Engine(model, medusa_heads=model)
