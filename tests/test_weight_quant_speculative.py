"""Weight-quantized models (hf_accel int8 / int4) on the speculative paths: `draft_generate` (a float draft) and
`medusa_generate` give the quantized model's own plain greedy output token for token, on DynamicCache and the paged
cache."""

import pytest
import torch
from tiny_llama import tiny_llama

from hf_accel import (
    MedusaHeads, SpeculativeStats, WeightOnlyConfig, bench, draft_generate, medusa_generate, quantize_model,
)

CONFIGS = {"int8": WeightOnlyConfig(bits=8), "int4": WeightOnlyConfig(bits=4, group_size=32)}
CACHES = {"dynamic": {}, "paged": {"cache_implementation": "paged", "cache_config": {"block_size": 4}}}
NEW = 16
VOCAB = 128  # tiny_llama's
WIDE_TREE = [(i,) for i in range(VOCAB)] + [(0, 0), (0, 1), (1, 0), (0, 0, 0)]  # every token at depth 1


@pytest.fixture(scope="module")
def float_model():
    return tiny_llama()


@pytest.fixture(scope="module", params=CONFIGS)
def quantized(request, float_model):
    return quantize_model(float_model, CONFIGS[request.param])


def _prompts(lengths, seed):
    return bench.make_prompts(lengths, VOCAB, pad_token_id=0, seed=seed)  # left-padded, with attention_mask


def _greedy(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("cache", CACHES)
def test_draft_generate_equals_the_quantized_models_plain_greedy(quantized, float_model, cache):
    stats = SpeculativeStats()
    for seed, lengths in enumerate(([12], [12, 7, 9])):  # batch 1 and a left-padded batch
        inputs = _prompts(lengths, seed)
        expected = _greedy(quantized, inputs)
        out = _greedy(quantized, inputs, custom_generate=draft_generate, draft_model=float_model, draft_stats=stats,
                      **CACHES[cache])
        assert torch.equal(out, expected), f"prompts {lengths}"
    assert stats.acceptance_rate > 0  # the float draft's tokens were accepted: the acceptance path ran


@pytest.mark.parametrize("cache", CACHES)
def test_medusa_generate_equals_the_quantized_models_plain_greedy(quantized, cache):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        heads = MedusaHeads.for_model(quantized, num_heads=3)  # projections from the (float) lm_head
    stats = SpeculativeStats()
    for seed in range(2):
        inputs = _prompts([9 + 3 * seed], seed)
        out = _greedy(quantized, inputs, custom_generate=medusa_generate, medusa_heads=heads, medusa_tree=WIDE_TREE,
                      medusa_stats=stats, **CACHES[cache])
        assert torch.equal(out, _greedy(quantized, inputs)), f"prompt {seed}"
    assert stats.accepted[0] > 0  # candidates were accepted, not only the base model's own token
