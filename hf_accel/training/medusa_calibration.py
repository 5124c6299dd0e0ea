"""How well Medusa heads predict, and the candidate tree that follows from it.

`rank_accuracy` measures, for each head k and rank i, how often head k's i-th best token at position t is the token
at t+2+k; on held-out text that is the heads' accuracy, on the model's own greedy output it is the chance that a
candidate is accepted, which `calibrate_tree` turns into a sparse tree (`tree.sparse_tree`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..speculative.medusa_heads import MedusaHeads
from ..speculative.tree import sparse_tree


@torch.no_grad()
def rank_accuracy(
    model: PreTrainedModel, heads: MedusaHeads, rows: torch.Tensor, max_rank: int = 1, batch_size: int = 4,
    skip: int = 0,
) -> torch.Tensor:
    """`[num_heads, max_rank]`: fraction of positions t (from `skip` on) of `rows` `[n, seq]` where head k's
    rank-i token equals token t+2+k."""
    hits, count = torch.zeros(heads.num_heads, max_rank), torch.zeros(heads.num_heads)
    device = next(model.parameters()).device
    for start in range(0, rows.shape[0], batch_size):
        ids = rows[start : start + batch_size].to(device)
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states[-1]
        top = heads(hidden.to(heads.lm_heads[0].weight.dtype)).topk(max_rank, dim=-1).indices  # [K, n, seq, ranks]
        for k in range(heads.num_heads):
            truth = ids[:, skip + k + 2 :]  # [n, seq - skip - k - 2]
            hits[k] += (top[k, :, skip : -(k + 2)] == truth[..., None]).sum(dim=(0, 1)).cpu().float()
            count[k] += truth.numel()
    return hits / count.clamp_min(1)[:, None]


def head_accuracy(model: PreTrainedModel, heads: MedusaHeads, rows: torch.Tensor) -> list[float]:
    """Per-head top-1 accuracy on `rows` `[n, seq]`: how often head k's argmax at t equals token t+2+k."""
    return rank_accuracy(model, heads, rows)[:, 0].tolist()


def calibrate_tree(
    model: PreTrainedModel, heads: MedusaHeads, prompts: torch.Tensor, new_tokens: int = 96, num_candidates: int = 32,
    max_rank: int = 10,
) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """A sparse tree of `num_candidates` paths for `heads`, from their rank accuracy on the model's own greedy
    continuations of `prompts` `[n, prompt_len]` (no padding). Returns the paths and the `[heads, max_rank]` rates."""
    generated = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=model.generation_config.pad_token_id)
    rates = rank_accuracy(model, heads, generated, max_rank=max_rank, skip=prompts.shape[1] - 1)
    return sparse_tree(rates, num_candidates), rates
