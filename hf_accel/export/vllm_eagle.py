"""Export an EAGLE head as the EAGLE-3 draft vLLM loads (targeted: vLLM 0.32, `llama_eagle3.py`).

vLLM reads a folder holding `config.json` (a one-layer Llama config with `architectures: ["LlamaForCausalLMEagle3"]`,
which its registry maps to `Eagle3LlamaForCausalLM`, and `eagle_config.eagle_aux_hidden_state_layer_ids`: the
target layers whose inputs it fuses) and safetensors weights. `EagleHead` has EAGLE-3's layer, so the tensors are
written under their own names: `fc.weight`, `midlayer.*` (vLLM maps `midlayer.` to `layers.0.` and stacks q/k/v and
gate/up), `norm.weight`. No `embed_tokens` and no `lm_head` are written: vLLM then shares the target's, as the head
does. vLLM's `Eagle3LlamaForCausalLM.load_weights` reports nothing, so a missing tensor would stay at its initial
value silently: `benchmarks/check_vllm_eagle.py` checks that vLLM drafts what `eagle_generate` drafts.
Use: `LLM(model=base, speculative_config={"method": "eagle3", "model": folder, "num_speculative_tokens": K})`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..speculative.eagle_head import EagleHead

VLLM_WEIGHTS_NAME = "model.safetensors"
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
EXPORTABLE_MODEL_TYPES = ("llama",)  # vLLM's Eagle3LlamaForCausalLM layer: no q/k norms, no attention bias


def check_exportable(head: EagleHead) -> None:
    """`ValueError` naming `eagle` when the head's layer is not the Llama layer vLLM's EAGLE-3 draft builds."""
    layer_config = head.config.layer_config
    model_type = layer_config.get("model_type")
    if model_type not in EXPORTABLE_MODEL_TYPES or layer_config.get("attention_bias") or layer_config.get("mlp_bias"):
        raise ValueError(f"eagle: vLLM's EAGLE-3 draft is a Llama layer without biases; this head's layer is a "
                         f"{model_type!r} layer (exportable: {', '.join(EXPORTABLE_MODEL_TYPES)})")


def vllm_config(head: EagleHead, dtype: torch.dtype) -> dict[str, Any]:
    """The draft's `config.json`: the head's one-layer config plus the fields vLLM's EAGLE-3 path reads."""
    config = dict(head.config.layer_config)
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "layer_types"):
        config.pop(key, None)
    config.update({
        "architectures": [VLLM_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "vocab_size": head.config.vocab_size,
        "draft_vocab_size": head.config.vocab_size,  # no reduced draft vocabulary: no d2t map
        "target_hidden_size": head.config.hidden_size,
        "tie_word_embeddings": False,  # no lm_head in the checkpoint: vLLM shares the target's
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.config.feature_layers),
                         "use_aux_hidden_state": True},
        "dtype": str(dtype).removeprefix("torch."),
        "base_model_name_or_path": head.config.base_model_name_or_path,
    })
    return config


def vllm_tensors(head: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`fc.weight` `[H, 3H]`, `midlayer.*` (q/k/v `[out, 2H]`, `hidden_norm`), `norm.weight`: the head's state."""
    return {name: tensor.detach().to(dtype).contiguous().cpu() for name, tensor in head.state_dict().items()}


def export_vllm(head: EagleHead, save_directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` and `model.safetensors` for vLLM's EAGLE-3 speculator into `save_directory`; returns it.

    `dtype` defaults to the head's own. Raises `ValueError` (see `check_exportable`) before writing anything.
    """
    check_exportable(head)
    dtype = dtype or head.dtype
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(vllm_tensors(head, dtype), folder / VLLM_WEIGHTS_NAME, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(vllm_config(head, dtype), indent=2) + "\n")
    return folder
