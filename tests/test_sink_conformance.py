"""SinkCache held to the cache conformance suite while everything fits in the window: token for token DynamicCache.

The window (64 tokens) is longer than every prompt + generation of the suite, so nothing is evicted and the sink
cache must be exact. Eviction itself is checked against an independent reference in test_sink_positions.py.
"""

import functools

import pytest
import torch
import transformers

import hf_accel
from conformance import _COMMON, ARCHITECTURES, MODES, CacheSpec, make_model

WINDOW = {"window_length": 64, "num_sink_tokens": 4}
SINK = CacheSpec("sink", hf_accel.SinkCache, {"cache_implementation": "sink", "cache_config": WINDOW})
SINK_ZERO_PATCH = CacheSpec("sink-zero-patch", hf_accel.SinkCache,
                            cache_factory=lambda model: hf_accel.SinkCache(model.config, **WINDOW))
# every architecture of the suite (mistral with sliding_window: all layers are transformers' sliding layers), plus
# mistral without a sliding window (all layers sink layers)
ARCHS = ("llama", "mistral", "mistral-full", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


@functools.lru_cache(maxsize=None)
def _model(arch: str, dtype: torch.dtype, attn: str) -> transformers.PreTrainedModel:
    if arch != "mistral-full":
        return make_model(arch, dtype, attn)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = transformers.MistralConfig(**_COMMON, sliding_window=None)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def _attns(arch: str) -> tuple[str, ...]:
    return ARCHITECTURES["mistral" if arch == "mistral-full" else arch][1]



# fp32 x every decoding mode, sdpa where the architecture has it, eager for llama too
CASES = [(a, "sdpa" if "sdpa" in _attns(a) else "eager", m) for a in ARCHS for m in MODES]


@pytest.mark.parametrize("arch, attn, mode", CASES + [("llama", "eager", m) for m in MODES])
def test_sink_within_window(arch, attn, mode):
    MODES[mode](_model(arch, torch.float32, attn), SINK)


@pytest.mark.parametrize("arch, mode", [(a, m) for a in ("llama",) for m in MODES])
def test_sink_within_window_bf16(arch, mode):
    MODES[mode](_model(arch, torch.bfloat16, "sdpa"), SINK)


# `past_key_values=SinkCache(model.config, ...)`: built without generate's padding mask and sizing hint
@pytest.mark.parametrize("arch, mode", [(a, m) for a in ("qwen2",) for m in MODES])
def test_sink_zero_patch_within_window(arch, mode):
    MODES[mode](_model(arch, torch.float32, "sdpa"), SINK_ZERO_PATCH)
