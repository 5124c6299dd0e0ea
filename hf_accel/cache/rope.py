"""Rotary position embeddings as far as a cache needs them: a model's inverse frequencies, and moving keys that are
already rotated to another position.

RoPE rotates each pair of dimensions `(i, i + rotary_dim / 2)` of a key at position p by the angle `p * inv_freq[i]`
(the rotate-half layout of every Llama-family model in transformers). Rotations compose, so a key cached at
position p moves to position p + delta by one more rotation of `delta * inv_freq[i]`, with plain cos / sin: the
model's `attention_scaling` is already in the cached key and must not be applied twice.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .kv_shape import config_head_dim


def rope_inverse_frequencies(config: PreTrainedConfig, layer_type: str = "full_attention") -> torch.Tensor:
    """The fp32 inverse frequencies `[rotary_dim / 2]` the model applies to keys of `layer_type` layers.

    Raises `ValueError` naming `config` when the model has no rotary embedding, or one whose frequencies change with
    the sequence length ("dynamic", "longrope"): keys cached under one set of frequencies could not be moved.
    """
    text_config = config.get_text_config(decoder=True)
    params = _rope_parameters(text_config, layer_type)
    rope_type = params.get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ValueError(
            f"The sink cache moves cached keys to new positions, which needs fixed RoPE frequencies; this model's "
            f"`config` uses rope_type={rope_type!r}, whose frequencies change with the sequence length"
        )
    if rope_type == "default":
        dim = int(config_head_dim(text_config) * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type not in ROPE_INIT_FUNCTIONS:
        supported = ["default", *sorted(set(ROPE_INIT_FUNCTIONS) - {"dynamic", "longrope"})]
        raise ValueError(f"The sink cache supports RoPE types {supported}; this model's `config` uses "
                         f"rope_type={rope_type!r}")
    per_layer_type = layer_type in text_config.rope_parameters
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](text_config, "cpu", layer_type=layer_type if per_layer_type else None)
    return inv_freq.float()


def _rope_parameters(text_config: PreTrainedConfig, layer_type: str) -> dict[str, Any]:
    params = getattr(text_config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise ValueError(
            f"The sink cache re-positions keys with rotary position embeddings (RoPE); this model's `config` "
            f"({type(text_config).__name__}) has no `rope_parameters`, so its positions cannot be re-applied"
        )
    if isinstance(params.get(layer_type), dict):  # one set of parameters per layer type (e.g. Gemma3)
        return params[layer_type]
    return params


def rotation(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `(cos, sin)`, each `[n, rotary_dim]`, of the rotation by `delta[i]` positions (`delta`: `[n]`)."""
    angles = delta.to(torch.float32)[:, None] * inv_freq.to(delta.device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`keys` `[rows, heads, n, head_dim]` rotated further by one rotation per row (`cos`, `sin`: `[rows, rotary_dim]`,
    from `rotation`); computed in fp32, returned in the keys' dtype. Dimensions past `rotary_dim` pass unchanged."""
    rotary_dim = cos.shape[-1]
    x = keys[..., :rotary_dim].float()
    half = rotary_dim // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    out = (x * cos + rotated_half * sin).to(keys.dtype)
    return out if rotary_dim == keys.shape[-1] else torch.cat((out, keys[..., rotary_dim:]), dim=-1)
