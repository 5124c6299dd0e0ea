"""Training-time test (EAGLE-3): the head run over a whole row for several draft steps, each feeding it its own
previous outputs, with the attention each draft step has when decoding.

Entry t of step 0 pairs the target's fused feature at position t with token t+1 (position id t) and predicts token
t+2. Entry t of step j > 0 pairs the head's step j-1 output at entry t with token t+j+1 (position id t+j) and
predicts token t+j+2: draft step j+1 after a verification that ended at position t. Every step appends its keys to
one cache; a step-j query at entry t sees step 0's entries up to t (the target-feature entries decoding has
cached) and its own chain, the entries t of steps 1..j (`unroll_mask`), as `eagle_draft.HeadState` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from ..speculative.eagle_head import EagleHead, token_embeddings


def unroll_mask(num_entries: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask `[1, 1, n, (step + 1) * n]` of step `step`'s queries over the keys of steps 0..step: causal
    over step 0, the diagonal of every later step (0 attend, dtype min masked)."""
    entries = torch.arange(num_entries, device=device)
    blocks = [entries[None, :] <= entries[:, None]] + [entries[None, :] == entries[:, None]] * step
    allowed = torch.cat(blocks, dim=1)
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def unrolled_hidden(model: PreTrainedModel, head: EagleHead, hidden: torch.Tensor, input_ids: torch.Tensor,
                    num_steps: int) -> list[torch.Tensor]:
    """The head's outputs `[batch, seq - 1, H]` for draft steps 0..num_steps-1 over rows `input_ids` `[batch, seq]`
    whose target feature states are `hidden` `[batch, seq, 3H]` (entries past the row's end read padding)."""
    batch, seq = input_ids.shape
    n = seq - 1
    padded = torch.cat([input_ids, input_ids.new_zeros(batch, num_steps)], dim=1)
    features = head.fc(hidden[:, :n].to(head.dtype))
    cache, outputs = DynamicCache(), []
    positions = torch.arange(n, device=input_ids.device)[None].expand(batch, -1)
    for step in range(num_steps):
        tokens = padded[:, step + 1 : step + 1 + n]
        mask = unroll_mask(n, step, features.dtype, input_ids.device)
        features = head(features, token_embeddings(model, tokens), positions + step, mask, cache)
        outputs.append(features)
    return outputs


def unrolled_loss(model: PreTrainedModel, head: EagleHead, outputs: list[torch.Tensor], labels: torch.Tensor,
                  step_decay: float) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy of step j's logits at entry t against the target's greedy token after position t+j+1
    (`labels` `[batch, seq]`), weighted `step_decay ** j`; returns the loss and each step's top-1 accuracy."""
    total, accuracy = 0.0, []
    for step, hidden in enumerate(outputs):
        count = hidden.shape[1] - step  # entries whose target token lies inside the row
        logits = head.logits(model, hidden[:, :count])
        truth = labels[:, step + 1 : step + 1 + count]
        total = total + step_decay**step * F.cross_entropy(logits.flatten(0, 1), truth.flatten())
        accuracy.append(float((logits.argmax(-1) == truth).float().mean()))
    return total, accuracy
