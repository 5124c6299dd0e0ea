"""RoPE as the sink cache uses it: the model's own inverse frequencies, and moving a cached key by `delta` positions
equals the model rotating the raw key at the new position (attention scaling applied once)."""

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_accel.cache.rope import rope_inverse_frequencies, rotate, rotation
from test_sink_positions import CONFIGS, one_layer_model

CONFIGS_TO_CHECK = {
    **CONFIGS,
    "llama3": lambda: transformers.LlamaConfig(**CONFIGS["llama"]().to_dict() | {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
}


def _model_inv_freq(model: transformers.PreTrainedModel) -> torch.Tensor:
    rotary = model.model.rotary_emb
    buffers = dict(rotary.named_buffers())
    return buffers.get("full_attention_inv_freq", buffers.get("inv_freq"))


@pytest.mark.parametrize("name", list(CONFIGS_TO_CHECK))
def test_inverse_frequencies_are_the_models_own(name):
    config = CONFIGS_TO_CHECK[name]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert torch.allclose(rope_inverse_frequencies(config), _model_inv_freq(model).float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["llama", "llama-yarn", "phi3-partial"])
def test_moving_a_rotated_key_equals_rotating_it_at_the_new_position(name):
    model = one_layer_model(name)
    rotary = model.model.rotary_emb
    raw = torch.randn(3, 2, 4, model.config.head_dim if name != "phi3-partial" else 16)  # [rows, heads, n, dim]
    start, delta = torch.tensor([[5], [0], [40]]), torch.tensor([7, 3, 1000])

    def at(positions: torch.Tensor) -> torch.Tensor:  # the model's RoPE of raw keys at positions [rows, 1]
        cos, sin = rotary(raw, positions.expand(-1, raw.shape[2]))
        rotary_dim = cos.shape[-1]
        _, keys = apply_rotary_pos_emb(raw[..., :rotary_dim], raw[..., :rotary_dim], cos, sin)
        return torch.cat([keys, raw[..., rotary_dim:]], dim=-1)

    cos, sin = rotation(delta, rope_inverse_frequencies(model.config))
    assert torch.allclose(rotate(at(start), cos, sin), at(start + delta[:, None]), atol=1e-4)


def test_rotate_keeps_dtype_and_passes_dimensions_past_the_rotary_ones():
    keys = torch.randn(2, 1, 3, 8, dtype=torch.bfloat16)
    cos, sin = rotation(torch.tensor([0, 2]), torch.tensor([1.0, 0.5]))  # rotary_dim 4 of 8
    out = rotate(keys, cos, sin)
    assert out.dtype == torch.bfloat16 and torch.equal(out[..., 4:], keys[..., 4:]) and torch.equal(out[0], keys[0])
