"""What benchmarks run on: the model (hf_accel's reference target by default, a random-weight Llama when its assets
are missing, or any causal LM by path or hub id), its tokenizer, draft, Medusa heads and EAGLE head (`BenchModel`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..quant.presets import load_model, load_tokenizer
from ..speculative.eagle_head import EagleHead
from ..speculative.medusa_heads import MedusaHeads

RANDOM_MODEL_NOTE = (
    "random-weight Llama built from a config: speed, memory and cache agreement are meaningful, the generated text "
    "is not"
)


def random_llama(
    hidden_size: int = 256,
    num_layers: int = 4,
    vocab_size: int = 4096,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    max_position_embeddings: int = 8192,
) -> LlamaForCausalLM:
    """A random-weight Llama, eval mode, no EOS: MLP width `hidden_size * 8 // 3`, `num_heads` attention heads
    (default `hidden_size / 32`, of 32 dims) and `num_kv_heads` KV heads (default half as many)."""
    torch.manual_seed(seed)
    heads = num_heads or max(hidden_size // 32, 1)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_kv_heads or max(heads // 2, 1),
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@dataclass(slots=True)
class BenchModel:
    """What a benchmark runs on: the model, its tokenizer (None for a random model), an optional draft model and
    Medusa heads and EAGLE head for the speculative rows, and a one-line description."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    draft: PreTrainedModel | None
    description: str
    medusa_heads: MedusaHeads | None = None
    eagle_head: EagleHead | None = None


def load_bench_model(name: str | None, draft: str | None = None, dtype: torch.dtype = torch.float32) -> BenchModel:
    """`name` (local path, hub id or GGUF file) and `draft` loaded with `load_model`; by default hf_accel's reference
    target and draft (or, when their assets are missing, a random-weight Llama and no draft)."""
    if name is None:
        if not reference.has_assets():
            model = random_llama(dtype=dtype)
            return BenchModel(model, None, None, f"{describe_model(model)}; {RANDOM_MODEL_NOTE}")
        model, tokenizer = reference.load("target", dtype=dtype)
        draft_model = reference.load("draft", dtype=dtype)[0] if draft is None else _pretrained(draft, dtype)
        heads_folder = reference.ASSETS_DIR / "medusa"
        heads = MedusaHeads.from_pretrained(heads_folder).to(dtype) if heads_folder.is_dir() else None
        has_eagle = (reference.ASSETS_DIR / "eagle" / "eagle_config.json").is_file()
        eagle = reference.load_head("eagle", model, dtype=dtype) if has_eagle else None
        return BenchModel(model, tokenizer, draft_model, f"hf_accel reference target: {describe_model(model)}", heads,
                          eagle)
    model = _pretrained(name, dtype)
    tokenizer = load_tokenizer(name)
    return BenchModel(model, tokenizer, None if draft is None else _pretrained(draft, dtype),
                      f"{name}: {describe_model(model)}")


def _pretrained(name: str, dtype: torch.dtype) -> PreTrainedModel:
    """`name` in eval mode through `load_model` (`from_pretrained`, or a GGUF file with its weights kept packed)."""
    return load_model(name, dtype=dtype).eval()


def describe_model(model: PreTrainedModel) -> str:
    config = model.config.get_text_config(decoder=True)
    params = sum(p.numel() for p in model.parameters())
    return (
        f"{config.model_type}, {params / 1e6:.1f}M params, hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads"
    )
