"""Depth growth: a deeper Llama initialised from a trained shallower one, computing exactly the same function.

Each trained layer ``i`` of an ``L``-layer model becomes layers ``i * f`` .. ``i * f + f - 1`` of the grown model
(``f = grown / L``): the first copy keeps the layer as it is, the others are copies whose attention output and MLP
down projections are zeroed, so they add nothing to the residual stream until training moves those weights. The
grown model's logits equal the original's at initialisation; continued training then only has to use the new depth,
which costs far less CPU than training the deeper model from scratch.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaForCausalLM

ZEROED_PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")  # each writes one sublayer's output into the residual


def grow_depth(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A new fp32 ``LlamaForCausalLM`` of ``num_layers`` layers (a multiple of ``model``'s) whose output equals
    ``model``'s; ``model`` is left unchanged."""
    old_layers = model.config.num_hidden_layers
    if not isinstance(num_layers, int) or num_layers < old_layers or num_layers % old_layers:
        raise ValueError(f"num_layers must be a multiple of the model's {old_layers} layers, got {num_layers!r}")
    factor = num_layers // old_layers
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [t for t in config.layer_types for _ in range(factor)]
    grown = LlamaForCausalLM(config).to(torch.float32)
    source = model.state_dict()
    state = {}
    for key, value in source.items():
        if not key.startswith("model.layers."):
            state[key] = value.float()
            continue
        index, rest = key.removeprefix("model.layers.").split(".", 1)
        for copy_index in range(factor):
            new_key = f"model.layers.{int(index) * factor + copy_index}.{rest}"
            zeroed = copy_index > 0 and rest.removesuffix(".weight").removesuffix(".bias") in ZEROED_PROJECTIONS
            state[new_key] = torch.zeros_like(value, dtype=torch.float32) if zeroed else value.float().clone()
    grown.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:
        grown.tie_weights()
    return grown.eval()


__all__ = ["grow_depth"]
