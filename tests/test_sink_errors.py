"""Bad input to the sink cache raises an error naming the argument; models it cannot serve are refused clearly, and
hybrid and all-sliding models work with the model's own window on the sliding layers."""

import pytest
import torch
import transformers

import hf_accel
from conformance import _COMMON, make_model, make_prompts

LLAMA = transformers.LlamaConfig(**_COMMON)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"window_length": 4, "num_sink_tokens": 4}, ValueError, "`window_length` \\(4\\) must be greater than"),
    ({"window_length": 2, "num_sink_tokens": 8}, ValueError, "window_length"),
    ({"window_length": 0}, ValueError, "`window_length` must be a positive int"),
    ({"window_length": -8}, ValueError, "`window_length` must be a positive int"),
    ({"num_sink_tokens": -1}, ValueError, "`num_sink_tokens` must be a non-negative int"),
    ({"window_length": 8.0}, TypeError, "`window_length` must be a positive int"),
    ({"window_length": "1024"}, TypeError, "`window_length`"),
    ({"num_sink_tokens": True}, TypeError, "`num_sink_tokens`"),
])
def test_bad_settings_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        hf_accel.SinkCacheConfig(**kwargs)
    with pytest.raises(error, match=match):
        hf_accel.SinkCache(LLAMA, **kwargs)


def test_bad_cache_config_in_generate():
    model, inputs = make_model("llama", torch.float32, "sdpa"), make_prompts([5])
    with pytest.raises(ValueError, match="Unknown sink cache_config keys \\['window'\\]; allowed keys are"):
        model.generate(**inputs, max_new_tokens=2, cache_implementation="sink", cache_config={"window": 8})
    with pytest.raises(ValueError, match="num_sink_tokens"):
        model.generate(**inputs, max_new_tokens=2, cache_implementation="sink",
                       cache_config={"window_length": 4, "num_sink_tokens": 4})
    with pytest.raises(TypeError, match="`cache_config` must be a dict"):
        hf_accel.SinkCacheConfig.from_dict([("window_length", 8)])


def test_defaults_are_streaming_llm_sized():
    assert hf_accel.SinkCacheConfig() == hf_accel.SinkCacheConfig(window_length=1024, num_sink_tokens=4)
    assert hf_accel.SinkCacheConfig(window_length=8, num_sink_tokens=0).num_recent_tokens == 8


def test_model_without_rope_is_refused():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="`config` \\(GPT2Config\\) has no `rope_parameters`"):
        hf_accel.SinkCache(config)
    model = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(ValueError, match="rope_parameters"):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, cache_implementation="sink")


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                   "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}])
def test_rope_whose_frequencies_change_with_length_is_refused(rope):
    config = transformers.LlamaConfig(**_COMMON, rope_parameters=rope)
    with pytest.raises(ValueError, match=f"`config` uses rope_type='{rope['rope_type']}'"):
        hf_accel.SinkCache(config)


def test_all_sliding_model_keeps_its_own_window_and_stays_bounded():
    # Mistral with `sliding_window`: every layer is transformers' sliding layer, as the sliding layers of hybrids
    model = make_model("mistral", torch.float32, "sdpa")
    kwargs = dict(max_new_tokens=40, min_new_tokens=40, pad_token_id=0, do_sample=False, return_dict_in_generate=True)
    out = model.generate(**make_prompts([9, 4]), cache_implementation="sink",
                         cache_config={"window_length": 12, "num_sink_tokens": 2}, **kwargs)
    reference = model.generate(**make_prompts([9, 4]), **kwargs)
    assert isinstance(out.past_key_values, hf_accel.SinkCache)
    assert torch.equal(out.sequences, reference.sequences)
    assert {type(layer).__name__ for layer in out.past_key_values.layers} == {"DynamicSlidingWindowLayer"}
    assert all(layer.keys.shape[2] == 7 for layer in out.past_key_values.layers)  # sliding_window - 1


def test_padding_mask_rows_must_match_the_batch():
    cache = hf_accel.SinkCache(LLAMA, window_length=8, attention_mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="holds 3 rows .* got 2"):
        cache.update(torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16), 0)
    with pytest.raises(ValueError, match="`attention_mask` must be a 2-D tensor"):
        hf_accel.SinkCache(LLAMA, attention_mask=torch.ones(4))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen2"])
def test_hybrid_models_keep_their_sliding_window_and_sinks_on_full_layers(arch):
    model = make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")
    with torch.no_grad():
        out = model.generate(**make_prompts([9, 4]), max_new_tokens=60, min_new_tokens=60, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, cache_implementation="sink",
                             cache_config={"window_length": 12, "num_sink_tokens": 2})
    cache = out.past_key_values
    assert all(torch.isfinite(logits).all() for logits in out.logits)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert kinds == {"SinkLayer", "DynamicSlidingWindowLayer"}
    for layer in cache.layers:
        stored = layer.keys.shape[2]  # the tokens kept: the window (sinks included), or sliding_window - 1
        assert stored == (12 if type(layer).__name__ == "SinkLayer" else 7), (type(layer).__name__, stored)
