"""GGUF files of tiny random models for tests, written with the `gguf` package the way llama.cpp's
`convert_hf_to_gguf.py` writes them (metadata names, tensor names, Llama's q / k rows interleaved for its rotary
layout), each tensor in the GGML type the test picks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: per head, rows (pair, half) -> (half, pair)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _add_tokenizer(writer, tokenizer) -> None:
    """A byte-level BPE tokenizer (tokenizer.json's vocab and merges) as llama.cpp's "gpt2" tokenizer metadata."""
    import json

    state = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id or 0)
    writer.add_eos_token_id(tokenizer.eos_token_id or 0)


def write_gguf(model: torch.nn.Module, path: Path, architecture: str, types: dict[str, str] | None = None,
               default: str = "F32", tokenizer=None) -> Path:
    """`model` (a transformers Llama / Qwen2 / Qwen3 causal LM) as a GGUF file: tensor `name` in `types.get(name,
    default)` ("F32", "F16", "Q8_0", "Q4_0"; norms are always F32); no output tensor when the model ties it; with
    `tokenizer` (byte-level BPE) its vocabulary and merges too."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path, architecture)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        data = value.detach().float().numpy()
        if architecture == "llama" and key.endswith("q_proj.weight"):
            data = _interleaved(data, config.num_attention_heads)
        elif architecture == "llama" and key.endswith("k_proj.weight"):
            data = _interleaved(data, config.num_key_value_heads)
        kind = "F32" if data.ndim == 1 else (types or {}).get(name, default)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(data))
        elif kind == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
