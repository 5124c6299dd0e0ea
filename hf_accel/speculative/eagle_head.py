"""EAGLE-3-style draft head: one decoder layer of the target's own architecture over fused target features.

Entry t of the head's sequence pairs a feature for position t with the embedding of token t+1 and predicts token
t+2 (the target, having read token t+1, would predict it at position t+1). The feature is either the target's own
(`fuse`: the hidden states after a low, a middle and a high layer, concatenated, `fc` 3H -> H) or, for every draft
step after the first, the head's own output at the entry before (EAGLE-3's training-time test teaches it to read
both). `input_fc` (2H -> H) mixes [token embedding, feature]; the decoder layer (the target's class, built from a
copy of its config with one layer, so RoPE and attention match) runs over it with the head's own small KV cache;
the target's frozen final norm and LM head read the output out (`logits`). The target's embedding, norm and LM head
are never copied: a head is used with the model it was trained for.

Saved as `eagle_head.safetensors` + `eagle_config.json` (see `EagleConfig`).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..display import RichDisplay

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
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)  # fuses the low, middle and high target features
        self.input_fc = nn.Linear(2 * hidden, hidden, bias=False)  # mixes [token embedding, feature]
        self.layer = type(decoder.layers[0])(layer_config, layer_idx=0)
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
        head.layer.load_state_dict(model.get_decoder().layers[-1].state_dict())
        return head

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
        x = self.input_fc(torch.cat([token_embeds.to(self.dtype), features.to(self.dtype)], dim=-1))
        position_embeddings = self.rotary_emb(x, position_ids)
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                         use_cache=cache is not None, position_embeddings=position_embeddings, **attention_kwargs)
        return out[0] if isinstance(out, tuple) else out

    @contextlib.contextmanager
    def attention_implementation(self, name: str) -> Iterator[None]:
        """Run the decoder layer's attention through transformers' registered attention function `name` inside the
        block (compiled EAGLE runs the head over its own paged pool), its own implementation after."""
        config = self.layer.self_attn.config
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
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(tensors, folder / WEIGHTS_NAME, metadata={"format": "pt"})
        (folder / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, save_directory: str | Path, model: PreTrainedModel,
                        dtype: torch.dtype | None = None) -> EagleHead:
        """Load a head written by `save_pretrained` for `model` (the target it was trained for), on the model's
        device, in `dtype` (default: the dtype it was stored in)."""
        folder = Path(save_directory)
        if not (folder / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {folder}")
        config = EagleConfig(**json.loads((folder / CONFIG_NAME).read_text()))
        device = model.get_output_embeddings().weight.device
        state = load_file(folder / WEIGHTS_NAME, device=str(device))
        head = cls(config, model).to(device=device, dtype=dtype or next(iter(state.values())).dtype)
        head.load_state_dict(state)
        head.check_compatible(model)
        return head.eval()


def _check_readout(model: PreTrainedModel) -> None:
    decoder = model.get_decoder()
    for name in ("norm", "layers", "rotary_emb"):
        if not isinstance(getattr(decoder, name, None), nn.Module):
            raise ValueError(f"EAGLE heads need a decoder with `{name}` (Llama-style); "
                             f"{type(decoder).__name__} has none")


def target_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The head's output `[..., H]` read out through the target's final norm and LM head: fp32 logits."""
    weight = model.get_output_embeddings().weight
    return model.get_output_embeddings()(model.get_decoder().norm(hidden.to(weight.dtype))).float()


def token_embeddings(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's (frozen) input embeddings of `input_ids`."""
    return model.get_input_embeddings()(input_ids)
