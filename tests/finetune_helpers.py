"""Shared by the fine-tune tests: a tiny random Llama over the reference tokenizer's vocabulary."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()
