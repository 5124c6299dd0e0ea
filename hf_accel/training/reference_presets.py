"""Presets for the reference models: model shapes and training recipes, as data.

``MODEL_PRESETS`` holds the shapes (the target ~7.3M parameters in 8 layers, the draft ~0.7M in 1 layer, both with
tied embeddings and grouped-query attention so caches see ``kv_heads < heads``); ``TRAIN_RECIPES`` holds the step
counts, batch and learning rates, sized for training on a CPU (docs/reference-models.md states the throughput
measured behind them).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Shape of one Llama model; the vocabulary comes from the tokenizer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    context_length: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        if min(self.num_layers, self.intermediate_size, self.context_length) < 1:
            raise ValueError("num_layers, intermediate_size and context_length must be positive")

    def to_config(self, vocab_size: int, special_token_id: int) -> LlamaConfig:
        """A ``LlamaConfig`` whose bos, eos and pad are the tokenizer's one special token."""
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.context_length,
            tie_word_embeddings=True,
            bos_token_id=special_token_id,
            eos_token_id=special_token_id,
            pad_token_id=special_token_id,
        )


@dataclass(frozen=True, slots=True)
class TrainRecipe:
    """Optimisation settings: AdamW, linear warmup then cosine decay to ``min_lr_ratio * lr``; fp32 master weights,
    with the forward pass under CPU bf16 autocast when ``bf16_autocast``."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = False

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.seq_len) < 1:
            raise ValueError("steps, batch_size and seq_len must be positive")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be positive and min_lr_ratio in [0, 1]")

    @property
    def num_tokens(self) -> int:
        """Tokens seen over the whole run."""
        return self.steps * self.batch_size * self.seq_len


MODEL_PRESETS: dict[str, ModelPreset] = {
    "target": ModelPreset(256, 8, 4, 2, 768, 512),  # head_dim 64, as in most LLMs
    "draft": ModelPreset(128, 1, 2, 1, 384, 512),
    "tiny": ModelPreset(32, 2, 2, 1, 64, 64),  # tests only
}

# fp32 (bf16 autocast is slower than fp32 on CPUs without native bf16 arithmetic). Step counts are upper bounds:
# under `--time-budget` the learning rate decays on time. The shipped models' commands and throughput are in the
# model card, docs/reference-models.md.
TRAIN_RECIPES: dict[str, TrainRecipe] = {
    "target": TrainRecipe(steps=3000, batch_size=4, seq_len=512, lr=2e-3, warmup_steps=40),
    "draft": TrainRecipe(steps=1300, batch_size=4, seq_len=512, lr=3e-3, warmup_steps=40),
    "tiny": TrainRecipe(steps=30, batch_size=4, seq_len=64, lr=1e-2, warmup_steps=3),  # tests only
}
