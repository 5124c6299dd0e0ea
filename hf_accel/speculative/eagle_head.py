"""EAGLE-3 draft head: one decoder layer over fused target features, laid out as vLLM's EAGLE-3 drafts are.

Entry t of the head's sequence pairs a feature for position t with the embedding of token t+1 and predicts token
t+2 (the target, having read token t+1, would predict it at position t+1). The feature is either the target's own
(`fuse`: the hidden states after a low, a middle and a high layer, concatenated, `fc` 3H -> H) or, for every draft
step after the first, the head's own output at the entry before (EAGLE-3's training-time test teaches it to read
both). The layer (`midlayer`, the target's decoder-layer class built from a copy of its config with one layer, so
RoPE and attention match) is EAGLE-3's:

    x = [input_layernorm(embedding); hidden_norm(feature)]        # [.., 2H]: q/k/v read 2H
    h = feature + self_attn(x)                                     # the residual stream is the feature
    out = h + mlp(post_attention_layernorm(h))                     # [.., H], the next step's feature

and the head's own final `norm` plus the target's frozen LM head read `out` out (`logits`). The target's embedding
and LM head are never copied: a head is used with the model it was trained for. With a Llama target the weights
are vLLM's `Eagle3LlamaForCausalLM` checkpoint under their own names (`fc`, `midlayer.*`, `norm`; see
`hf_accel.export.vllm_eagle`), so vLLM drafts with it what `eagle_generate` drafts.

Saved as `eagle_head.safetensors` + `eagle_config.json` (see `EagleConfig`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..display import RichDisplay
from ..quant.linear import float_state_dict
from .head_files import read_head, save_head, stored_dtype

CONFIG_NAME = "eagle_config.json"
WEIGHTS_NAME = "eagle_head.safetensors"
_ATTENTION = ("sdpa", "eager")


@dataclass(slots=True)
class EagleConfig:
    """Shape of an EAGLE head and the target it was made for.

    Args:
        hidden_size: the target's hidden size H.
        vocab_size: rows of the target's LM head.
        num_target_layers: decoder layers of the target.
        feature_layers: three indices into the target's `output_hidden_states` tuple (0 = embeddings, i = after
            decoder layer i; the last entry is the final normed state): the low, middle and high features fused.
        layer_config: the target's text config with one layer (`to_dict()`), from which the decoder layer is built.
        base_model_name_or_path: where the target came from (informational).
        base_model_type: the target config's `model_type` (informational).
    """

    hidden_size: int
    vocab_size: int
    num_target_layers: int
    feature_layers: tuple[int, int, int]
    layer_config: dict[str, Any]
    base_model_name_or_path: str | None = None
    base_model_type: str | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}")
        layers = tuple(self.feature_layers)  # JSON gives a list
        if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i <= self.num_target_layers for i in layers):
            raise ValueError(f"`feature_layers` must be three hidden-state indices in [0, {self.num_target_layers}] "
                             f"(0 = embeddings, i = after decoder layer i), got {self.feature_layers!r}")
        self.feature_layers = layers


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice for a target of `num_layers` layers: the inputs of layers 2, L/2 and L-3 (hidden-state
    indices), kept inside [1, L]."""
    clamp = lambda i: min(max(i, 1), num_layers)  # noqa: E731
    return clamp(2), clamp(num_layers // 2), clamp(num_layers - 3)


class EagleHead(RichDisplay, nn.Module):
    """An EAGLE-3-style draft head for one target model (see the module docstring).

    Build one with `EagleHead.for_model(model)`, train it with `hf_accel.train_eagle`, decode with
    `model.generate(..., custom_generate=hf_accel.eagle_generate, eagle_head=head)`.
    """

    def __init__(self, config: EagleConfig, model: PreTrainedModel):
        super().__init__()
        self.config = config
        decoder = model.get_decoder()
        layer_config = type(model.config.get_text_config(decoder=True)).from_dict(copy.deepcopy(config.layer_config))
        implementation = model.config._attn_implementation
        layer_config._attn_implementation = implementation if implementation in _ATTENTION else "sdpa"
        self.fc = nn.Linear(3 * config.hidden_size, config.hidden_size, bias=False)  # fuses low, middle, high
        self.midlayer = _eagle3_layer(type(decoder.layers[0])(layer_config, layer_idx=0), config.hidden_size)
        self.norm = copy.deepcopy(decoder.norm)  # the head's own final norm (starts as the target's)
        self.rotary_emb = type(decoder.rotary_emb)(config=layer_config)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @classmethod
    def for_model(cls, model: PreTrainedModel, feature_layers: tuple[int, int, int] | None = None) -> EagleHead:
        """A new head sized for `model` (its dtype and device), its decoder layer a copy of the model's last one;
        `feature_layers` default to `default_feature_layers`."""
        text_config = model.config.get_text_config(decoder=True)
        _check_readout(model)
        num_layers = text_config.num_hidden_layers
        layer_config = copy.deepcopy(text_config)
        layer_config.num_hidden_layers = 1
        if getattr(layer_config, "layer_types", None) is not None:
            layer_config.layer_types = ["full_attention"]
        config = EagleConfig(
            hidden_size=text_config.hidden_size, vocab_size=model.get_output_embeddings().weight.shape[0],
            num_target_layers=num_layers, feature_layers=feature_layers or default_feature_layers(num_layers),
            layer_config=layer_config.to_dict(), base_model_name_or_path=getattr(model, "name_or_path", None) or None,
            base_model_type=getattr(text_config, "model_type", None),
        )
        weight = model.get_output_embeddings().weight
        head = cls(config, model).to(device=weight.device, dtype=weight.dtype)
        head.start_from(model.get_decoder().layers[-1])
        return head

    @torch.no_grad()
    def start_from(self, layer: nn.Module) -> None:
        """Copy a target decoder layer into `midlayer`: every weight as it is (a weight-quantized layer's dequantized),
        q/k/v into the feature half of their 2H-wide inputs (the embedding half keeps its initialisation)."""
        widened = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        state = self.midlayer.state_dict()
        for name, tensor in float_state_dict(layer).items():
            if name in widened:
                state[name][:, tensor.shape[1]:] = tensor
            else:
                state[name] = tensor
        self.midlayer.load_state_dict(state)

    def summary(self) -> dict[str, object]:
        """Shape, parameter count and target (what `repr` and the Jupyter table show)."""
        config = self.config
        return {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "feature_layers": list(config.feature_layers), "parameters": sum(p.numel() for p in self.parameters()),
                "base_model": config.base_model_name_or_path}

    def fuse(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target's `output_hidden_states` (each `[batch, seq, H]`) -> fused features `[batch, seq, H]`."""
        picked = [hidden_states[i].to(self.dtype) for i in self.config.feature_layers]
        return self.fc(torch.cat(picked, dim=-1))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Cache | None, **attention_kwargs: Any) -> torch.Tensor:
        """One pass of the decoder layer over new entries: `features`, `token_embeds` `[batch, q, H]`,
        `position_ids` `[batch, q]`, `attention_mask` additive `[batch, 1, q, cached + q]` (None: causal-free, for
        q == 1 attending to everything cached). Appends the entries' K/V to `cache`; returns `[batch, q, H]`.
        `attention_kwargs` reach the layer's attention function (hf_accel's paged attention reads its
        `hf_accel_step` there, with `cache` None: see `attention_implementation`)."""
        layer, features = self.midlayer, features.to(self.dtype)
        x = torch.cat([layer.input_layernorm(token_embeds.to(self.dtype)), layer.hidden_norm(features)], dim=-1)
        position_embeddings = self.rotary_emb(x, position_ids)
        attended, _ = layer.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, past_key_values=cache, position_ids=position_ids,
                                      use_cache=cache is not None, **attention_kwargs)
        hidden = features + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
        """The head's output `[..., H]` read out through its own final norm and `model`'s LM head: fp32 logits."""
        lm_head = model.get_output_embeddings()
        return lm_head(self.norm(hidden).to(lm_head.weight.dtype)).float()

    @contextlib.contextmanager
    def attention_implementation(self, name: str) -> Iterator[None]:
        """Run the decoder layer's attention through transformers' registered attention function `name` inside the
        block (compiled EAGLE runs the head over its own paged pool), its own implementation after."""
        config = self.midlayer.self_attn.config
        saved = config._attn_implementation
        config._attn_implementation = name
        try:
            yield
        finally:
            config._attn_implementation = saved

    def check_compatible(self, model: PreTrainedModel) -> None:
        """Raise `ValueError` (naming `eagle_head`) when this head does not fit `model`."""
        text_config = model.config.get_text_config(decoder=True)
        found = (text_config.hidden_size, model.get_output_embeddings().weight.shape[0], text_config.num_hidden_layers)
        wanted = (self.config.hidden_size, self.config.vocab_size, self.config.num_target_layers)
        if found != wanted:
            raise ValueError(f"`eagle_head` was made for (hidden, vocab, layers) = {wanted}, the model has {found}")
        _check_readout(model)

    def save_pretrained(self, save_directory: str | Path) -> None:
        """Write `eagle_head.safetensors` and `eagle_config.json` into `save_directory` (created if needed)."""
        save_head(self, self.config, save_directory, WEIGHTS_NAME, CONFIG_NAME)

    @classmethod
    def from_pretrained(cls, save_directory: str | Path, model: PreTrainedModel,
                        dtype: torch.dtype | None = None) -> EagleHead:
        """Load a head written by `save_pretrained` for `model` (the target it was trained for), on the model's
        device, in `dtype` (default: the dtype it was stored in)."""
        device = model.get_output_embeddings().weight.device
        fields, state = read_head(save_directory, WEIGHTS_NAME, CONFIG_NAME, device)
        if "input_fc.weight" in state:
            raise ValueError(f"{save_directory} holds an EAGLE head of hf_accel's earlier layout (`input_fc`); heads "
                             "now use EAGLE-3's layer (vLLM's layout): retrain it with `hf_accel.train_eagle`")
        head = cls(EagleConfig(**fields), model).to(device=device, dtype=dtype or stored_dtype(state))
        head.load_state_dict(state)
        head.check_compatible(model)
        return head.eval()


def _check_readout(model: PreTrainedModel) -> None:
    decoder = model.get_decoder()
    for name in ("norm", "layers", "rotary_emb"):
        if not isinstance(getattr(decoder, name, None), nn.Module):
            raise ValueError(f"EAGLE heads need a decoder with `{name}` (Llama-style); "
                             f"{type(decoder).__name__} has none")
    layer = decoder.layers[0]
    parts = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj")
    missing = [part for part in parts if not _has(layer, part)]
    if missing:
        raise ValueError(f"EAGLE heads need a Llama-style decoder layer (pre-norm attention and MLP, separate q/k/v "
                         f"projections); {type(layer).__name__} has no {', '.join(missing)}")


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _eagle3_layer(layer: nn.Module, hidden_size: int) -> nn.Module:
    """`layer` (a fresh target decoder layer) turned into EAGLE-3's: q/k/v read `2 * hidden_size` features
    ([embedding; feature]) and a `hidden_norm` (the input norm's class) normalises the feature."""
    attention = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        linear = getattr(attention, name)
        setattr(attention, name, nn.Linear(2 * hidden_size, linear.out_features, bias=linear.bias is not None))
    layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
    return layer


def token_embeddings(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's (frozen) input embeddings of `input_ids`."""
    return model.get_input_embeddings()(input_ids)
