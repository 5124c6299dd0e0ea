"""A tiny random-weight Llama (hidden 64, vocab 128) shared by the unit tests; never downloaded."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(num_hidden_layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()
