"""Export Medusa heads in the layout vLLM's Medusa speculator loads (targeted: vLLM 0.10).

vLLM reads a folder holding `config.json` (`model_type: "medusa"`, parsed by
`vllm/transformers_utils/configs/medusa.py: MedusaConfig`) and safetensors weights loaded by
`vllm/model_executor/models/medusa.py: Medusa.load_weights`. Its modules: `blocks[k]` is a `ResidualBlock` whose
`layers[j]` are `nn.Linear(hidden, hidden, bias=config.medusa_fc_bias)` applied as `x = x + SiLU(layer(x))`, and
`lm_heads[k]` maps hidden -> `truncated_vocab_size` (= vocab without a token map). hf_accel's `MedusaHeads` uses the
same module names, so the tensors are written unchanged; the mapping of config fields is in docs/medusa.md.
Use: `LLM(model=base, speculative_config={"method": "medusa", "model": folder, "num_speculative_tokens": K})`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..speculative.medusa_heads import MedusaHeads

VLLM_TARGET = "vLLM 0.10 (vllm/model_executor/models/medusa.py, vllm/transformers_utils/configs/medusa.py)"
VLLM_WEIGHTS_NAME = "model.safetensors"


def vllm_config(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, Any]:
    """The `config.json` vLLM's `MedusaConfig` reads for `heads` (its fields, plus the flags its model consults)."""
    config = heads.config
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "truncated_vocab_size": config.vocab_size,  # no token map: every head predicts the full vocabulary
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,  # residual layers per head
        "medusa_fc_bias": True,  # hf_accel's residual Linears have a bias
        "original_lm_head": False,  # one lm_head per head
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "base_model_name_or_path": config.base_model_name_or_path,
        "base_model_type": config.base_model_type,
    }


def vllm_tensors(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`blocks.{k}.layers.{j}.weight` `[hidden, hidden]`, `blocks.{k}.layers.{j}.bias` `[hidden]` and
    `lm_heads.{k}.weight` `[vocab, hidden]`, as vLLM's `Medusa.named_parameters()` names them."""
    return {name: tensor.detach().to(dtype).contiguous().cpu() for name, tensor in heads.state_dict().items()}


def export_vllm(heads: MedusaHeads, save_directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` and `model.safetensors` for vLLM's Medusa speculator into `save_directory`; returns it.

    `dtype` defaults to the heads' own.
    """
    dtype = dtype or heads.lm_heads[0].weight.dtype
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(vllm_tensors(heads, dtype), folder / VLLM_WEIGHTS_NAME, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(vllm_config(heads, dtype), indent=2) + "\n")
    return folder
