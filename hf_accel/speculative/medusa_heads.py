"""Medusa heads: K small residual heads on a frozen model's last hidden state; head k predicts token t+2+k.

The base model's own lm_head at position t predicts token t+1; head k (0-based) at the same position predicts token
t+2+k (Medusa-1, Cai et al. 2024). Each head is a residual block (`x + SiLU(Linear(x))`, `num_layers` times) then its
own Linear to the vocabulary. The parameter names (`blocks.{k}.layers.{j}`, `lm_heads.{k}`) are the ones vLLM's
Medusa speculator loads, so `export_vllm` only has to write a different config.

Saved as `medusa_heads.safetensors` + `medusa_config.json` (see `MedusaConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..display import RichDisplay
from .head_files import read_head, save_head, stored_dtype

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"


@dataclass(slots=True)
class MedusaConfig:
    """Shape of a set of Medusa heads and the base model they were made for.

    Args:
        num_heads: heads K (head k predicts token t+2+k), at least 1.
        hidden_size: the base model's hidden size.
        vocab_size: the base model's vocabulary size (rows of its lm_head).
        num_layers: residual blocks per head, at least 1.
        base_model_name_or_path: where the base model came from (informational).
        base_model_type: the base config's `model_type` (informational).
        tree: candidate paths calibrated for these heads (`hf_accel.speculative.tree.sparse_tree`), used by
            `medusa_generate` when no `medusa_tree` is given; None: the built-in default tree.
    """

    num_heads: int
    hidden_size: int
    vocab_size: int
    num_layers: int = 1
    base_model_name_or_path: str | None = None
    base_model_type: str | None = None
    tree: list[tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "hidden_size", "vocab_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}")
        if self.tree is not None:  # JSON gives lists
            self.tree = [tuple(path) for path in self.tree]


class ResidualBlock(nn.Module):
    """`num_layers` times `x = x + SiLU(Linear(x))`; the Linears start at zero, so a new head starts as the identity."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)])
        self.act = nn.SiLU()
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(RichDisplay, nn.Module):
    """K Medusa heads. `forward(hidden)`: `[..., hidden_size]` -> logits `[K, ..., vocab_size]`.

    Build them for a model with `MedusaHeads.for_model(model, num_heads=4)` (each head's vocabulary projection starts
    as a copy of the model's lm_head), train with `hf_accel.train_medusa`, decode with
    `model.generate(..., custom_generate=hf_accel.medusa_generate, medusa_heads=heads)`.
    """

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        # K separate modules each (never one module repeated: that would tie their weights)
        self.blocks = nn.ModuleList(
            [ResidualBlock(config.hidden_size, config.num_layers) for _ in range(config.num_heads)]
        )
        self.lm_heads = nn.ModuleList(
            [nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)]
        )

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def summary(self) -> dict[str, object]:
        """Shape, parameter count, tree and base model (what `repr` and the Jupyter table show)."""
        config = self.config
        return {"num_heads": config.num_heads, "num_layers": config.num_layers, "hidden_size": config.hidden_size,
                "vocab_size": config.vocab_size, "parameters": sum(p.numel() for p in self.parameters()),
                "tree_paths": len(config.tree) if config.tree else "default",
                "base_model": config.base_model_name_or_path}

    @classmethod
    def for_model(
        cls, model: PreTrainedModel, num_heads: int = 4, num_layers: int = 1, init_from_lm_head: bool = True
    ) -> MedusaHeads:
        """New heads sized for `model` (its dtype and device); `init_from_lm_head` copies its lm_head weight into
        every head's projection, so an untrained head 0 predicts what the model predicts for the next token."""
        text_config = model.config.get_text_config(decoder=True)
        config = MedusaConfig(
            num_heads=num_heads, hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
            num_layers=num_layers, base_model_name_or_path=getattr(model, "name_or_path", None) or None,
            base_model_type=getattr(text_config, "model_type", None),
        )
        lm_head = model.get_output_embeddings()
        heads = cls(config).to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        if init_from_lm_head:
            with torch.no_grad():
                for head in heads.lm_heads:
                    head.weight.copy_(lm_head.weight[: config.vocab_size])
        return heads

    def forward(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """`hidden_states`: `[..., hidden_size]` (the base model's last, normed hidden state) -> `[K, ..., vocab]`,
        or with `num_heads` only the first `num_heads` heads, `[num_heads, ..., vocab]` (a shallow tree needs no
        deeper heads, and each head's vocabulary projection costs about what the base model's lm_head does)."""
        count = self.num_heads if num_heads is None else num_heads
        if not 1 <= count <= self.num_heads:
            raise ValueError(f"`num_heads` must be in [1, {self.num_heads}], got {num_heads}")
        pairs = zip(self.blocks[:count], self.lm_heads[:count])
        return torch.stack([head(block(hidden_states)) for block, head in pairs])

    def stacked(self, num_heads: int | None = None) -> StackedHeads:
        """The first `num_heads` heads (default all) as one batched forward (`StackedHeads`, a snapshot)."""
        count = self.num_heads if num_heads is None else num_heads
        if not 1 <= count <= self.num_heads:
            raise ValueError(f"`num_heads` must be in [1, {self.num_heads}], got {num_heads}")
        with torch.no_grad():
            layers = [block.layers for block in self.blocks[:count]]
            weights = tuple(torch.stack([head[i].weight.T for head in layers]).contiguous()
                            for i in range(self.config.num_layers))
            biases = tuple(torch.stack([head[i].bias for head in layers])[:, None]
                           for i in range(self.config.num_layers))
            vocab = torch.stack([head.weight.T for head in self.lm_heads[:count]]).contiguous()
        return StackedHeads(weights, biases, vocab)

    def check_compatible(self, model: PreTrainedModel) -> None:
        """Raise `ValueError` (naming `medusa_heads`) when these heads do not fit `model`'s hidden size or vocab."""
        text_config = model.config.get_text_config(decoder=True)
        lm_head = model.get_output_embeddings()
        vocab = lm_head.weight.shape[0] if lm_head is not None else text_config.vocab_size
        if self.config.hidden_size != text_config.hidden_size:
            raise ValueError(f"`medusa_heads` have hidden size {self.config.hidden_size}, the model "
                             f"{text_config.hidden_size}")
        if self.config.vocab_size != vocab:
            raise ValueError(f"`medusa_heads` have vocab size {self.config.vocab_size}, the model {vocab}")

    def save_pretrained(self, save_directory: str | Path) -> None:
        """Write `medusa_heads.safetensors` and `medusa_config.json` into `save_directory` (created if needed)."""
        save_head(self, self.config, save_directory, WEIGHTS_NAME, CONFIG_NAME)

    @classmethod
    def from_pretrained(
        cls, save_directory: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> MedusaHeads:
        """Load heads written by `save_pretrained` from a local folder (stored dtype unless `dtype` is given)."""
        fields, state = read_head(save_directory, WEIGHTS_NAME, CONFIG_NAME, device)
        heads = cls(MedusaConfig(**fields)).to(device=device, dtype=dtype or stored_dtype(state))
        heads.load_state_dict(state)
        return heads.eval()


@dataclass(frozen=True, slots=True)
class StackedHeads:
    """Heads whose weights are stacked so they all run as batched matmuls: two per residual layer and one for the
    vocabulary, instead of a Linear per head (docs/serving.md has the measured difference). A snapshot made by
    `MedusaHeads.stacked`: later changes to the heads are not seen."""

    block_weights: tuple[torch.Tensor, ...]  # per residual layer: [num_heads, hidden, hidden], input-major (x @ W)
    block_biases: tuple[torch.Tensor, ...]  # per residual layer: [num_heads, 1, hidden]
    vocab_weights: torch.Tensor  # [num_heads, hidden, vocab]

    @property
    def num_heads(self) -> int:
        return self.vocab_weights.shape[0]

    def __call__(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """`hidden_states` `[rows, hidden_size]` -> logits `[num_heads, rows, vocab]` of the first `num_heads` heads
        (default all), as `MedusaHeads.forward` computes them."""
        count = self.num_heads if num_heads is None else num_heads
        if not 1 <= count <= self.num_heads:
            raise ValueError(f"`num_heads` must be in [1, {self.num_heads}], got {num_heads}")
        x = hidden_states.to(self.vocab_weights.dtype).expand(count, *hidden_states.shape)  # [count, rows, hidden]
        for weights, biases in zip(self.block_weights, self.block_biases):
            x = x + F.silu(torch.baddbmm(biases[:count], x, weights[:count]))
        return torch.bmm(x, self.vocab_weights[:count])
