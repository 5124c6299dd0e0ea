"""What the frozen target gives an EAGLE head to learn from, computed once per training row.

The head reads three of the target's hidden states per position (its `feature_layers`) and learns the target's
greedy next token (self-distillation: on the target's own greedy output that is the next token of the text, so a
head that matches it drafts tokens greedy verification accepts). Both depend only on the frozen target, so they are
computed once, before training, and stored in bf16 (`TargetFeatures`): every later epoch costs only the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel


@dataclass(slots=True)
class TargetFeatures:
    """Per training row: `input_ids` `[rows, seq]`, the target's three feature hidden states concatenated
    (`hidden`, `[rows, seq, 3H]`, bf16) and its greedy next token at each position (`labels`, `[rows, seq]`)."""

    input_ids: torch.Tensor
    hidden: torch.Tensor
    labels: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(input_ids, hidden in fp32, labels)` of the rows `index`, on `device`."""
        return (self.input_ids[index].to(device), self.hidden[index].to(device, torch.float32),
                self.labels[index].to(device))


@torch.no_grad()
def target_features(model: PreTrainedModel, rows: torch.Tensor, feature_layers: tuple[int, ...],
                    batch_size: int = 16, progress: bool = False) -> TargetFeatures:
    """Run the frozen `model` over `rows` `[n, seq]` once and keep what the head trains on (`TargetFeatures`)."""
    device = next(model.parameters()).device
    hidden, labels = [], []
    for start in tqdm(range(0, rows.shape[0], batch_size), desc="target features", disable=not progress):
        ids = rows[start : start + batch_size].to(device)
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden.append(torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1).to(torch.bfloat16).cpu())
        labels.append(out.logits.argmax(dim=-1).cpu())
    return TargetFeatures(rows.long(), torch.cat(hidden), torch.cat(labels))
