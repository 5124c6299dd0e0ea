"""Weight-quantized models (int8, int4; fp32 and bf16) in every compiled decoding mode: hf_accel's compiled paged,
sink and quantized-KV loops, transformers' own StaticCache + compile, and the compiled speculative loops (n-gram,
draft, EAGLE, Medusa). Each cell gives the tokens the same quantized model gives eagerly in that mode (lossless
modes: its plain greedy output), so the kernels' custom ops trace into one graph and compute what eager does. The
eager cells of every cache are in test_weight_quant.py and test_weight_quant_speculative.py."""

import functools

import pytest
import torch
from conformance import PAD, make_draft_model, make_model, make_prompts
from transformers import CompileConfig

from hf_accel import (
    EagleHead, Int4Linear, Int8Linear, MedusaHeads, WeightOnlyConfig, draft_generate, eagle_generate, medusa_generate,
    ngram_generate, quantize_model,
)

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)
NEW = 12
FORMATS = {"int8": (8, None), "int4": (4, 32)}


@functools.lru_cache(maxsize=None)
def quantized(name: str, dtype: torch.dtype = torch.float32):
    bits, group_size = FORMATS[name]
    model = quantize_model(make_model("llama", dtype, "sdpa"), WeightOnlyConfig(bits=bits, group_size=group_size),
                           progress=False)
    layouts = {m.layout for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))}
    assert layouts == {"panels"}, layouts  # hf_accel's kernels, not torch's
    return model


def generate(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs)


CACHES = {
    "paged": {"cache_implementation": "paged", "cache_config": {"block_size": 4}},
    "sink": {"cache_implementation": "sink", "cache_config": {"window_length": 16, "num_sink_tokens": 2}},
    "quantized KV": {"cache_implementation": "quantized",
                     "cache_config": {"backend": "hf_accel", "nbits": 4, "group_size": 8, "residual_length": 8}},
}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", FORMATS)
def test_compiled_caches_equal_their_eager_runs(name, cache):
    model = quantized(name)
    inputs = make_prompts([7, 13], seed=3)
    eager = generate(model, inputs, **CACHES[cache])
    compiled = generate(model, inputs, compile_config=COMPILE, return_dict_in_generate=True, **CACHES[cache])
    assert compiled.past_key_values is None  # hf_accel's compiled loop ran
    assert torch.equal(compiled.sequences, eager)


def speculative_kwargs(method: str, model) -> dict:
    if method == "ngram":
        return {"custom_generate": ngram_generate, "draft_token_cost": 0.0}
    if method == "draft":
        float_model = make_model("llama", torch.float32, "sdpa")
        return {"custom_generate": draft_generate, "draft_model": make_draft_model(float_model)}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if method == "eagle":
            return {"custom_generate": eagle_generate, "eagle_head": EagleHead.for_model(model).eval()}
        return {"custom_generate": medusa_generate, "medusa_heads": MedusaHeads.for_model(model, num_heads=2).eval()}


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "medusa"])
@pytest.mark.parametrize("name", FORMATS)
def test_compiled_speculation_equals_plain_greedy(name, method):
    model = quantized(name)
    inputs = make_prompts([9, 14], seed=5, period=4)  # repeating prompts: n-gram lookup finds candidates
    out = generate(model, inputs, compile_config=COMPILE, return_dict_in_generate=True,
                   **speculative_kwargs(method, model))
    assert out.past_key_values is None  # the compiled loop ran
    assert torch.equal(out.sequences, generate(model, inputs))


@pytest.mark.parametrize("name", FORMATS)
def test_bf16_models_compile_with_quantized_weights(name):
    model = quantized(name, torch.bfloat16)
    inputs = make_prompts([7, 13], seed=4)
    compiled = generate(model, inputs, compile_config=COMPILE, **CACHES["paged"])
    assert torch.equal(compiled, generate(model, inputs, **CACHES["paged"]))
