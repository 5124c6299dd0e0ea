"""Acceptance rules for speculative decoding: pure functions on tensors, no model in sight.

Both rules take `k` draft tokens per row and the target's view of the `k + 1` positions they were verified at
(position j scores the token after the history plus drafts `1..j`), and return a `Verdict`: per row, how many drafts
were accepted (`n`) and the `n + 1` tokens the round emits (the accepted drafts, then the target's correction or,
when all `k` were accepted, a bonus token). Every emitted token is an exact sample of (greedy: equal to) what the
target alone would produce after the tokens before it, so a caller may keep any prefix of a row's emitted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Verdict:
    """Outcome of verifying one round of drafts.

    `num_accepted`: `[batch]` drafts accepted per row (0..k). `tokens`: `[batch, k + 1]`; row r's emitted tokens are
    `tokens[r, : num_accepted[r] + 1]` (entries past them repeat the drafts and mean nothing).
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        """`[batch]` tokens emitted per row: accepted drafts plus one."""
        return self.num_accepted + 1


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"`draft_tokens` must be [batch, k], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target.shape[0] != batch or target.shape[1] != k + 1:
        raise ValueError(f"target scores must be [batch={batch}, k + 1={k + 1}, ...], got {tuple(target.shape)}")


def _first_rejection(accepted: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    # accepted: [batch, k] bool -> [batch] length of the all-True prefix, at most num_drafts[r]
    if num_drafts is not None:
        accepted = accepted & (torch.arange(accepted.shape[1], device=accepted.device) < num_drafts[:, None])
    return accepted.to(torch.long).cumprod(dim=1).sum(dim=1)


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> Verdict:
    # tokens[r, :n] = drafts, tokens[r, n] = last[r]
    tokens = torch.cat([draft_tokens, draft_tokens[:, -1:]], dim=1) if draft_tokens.shape[1] else last[:, None].clone()
    tokens.scatter_(1, num_accepted[:, None], last[:, None])
    return Verdict(num_accepted, tokens)


def greedy_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> Verdict:
    """Greedy prefix match: accept drafts while they equal the target's argmax, then emit the target's token.

    Args:
        draft_tokens: `[batch, k]` candidates (k may be 0).
        target_tokens: `[batch, k + 1]` the target's greedy token at each verified position.
        num_drafts: `[batch]` candidates row r really drafted (its first `num_drafts[r]`; the rest is padding, never
            accepted); None: all k.
    """
    _check_shapes(draft_tokens, target_tokens)
    num_accepted = _first_rejection(draft_tokens == target_tokens[:, :-1], num_drafts)
    return _emit(draft_tokens, num_accepted, target_tokens.gather(1, num_accepted[:, None]).squeeze(1))


def speculative_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    num_drafts: torch.Tensor | None = None,
) -> Verdict:
    """Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023), per row.

    Draft j (sampled from q_j) is accepted with probability min(1, p_j(x) / q_j(x)); at the first rejection the
    emitted token is drawn from norm(max(p_j - q_j, 0)); when all k are accepted a bonus token is drawn from p_k.

    Args:
        draft_tokens: `[batch, k]` tokens the draft sampled.
        draft_probs: `[batch, k, vocab]` the draft distributions q they were sampled from.
        target_probs: `[batch, k + 1, vocab]` the target distributions p at the same positions, plus one.
        generator: optional torch generator for the uniform draws and the resampling.
        num_drafts: `[batch]` candidates row r really drafted (the rest is padding, never accepted: its `draft_probs`
            rows must be zero, so that the token after row r's last draft is drawn from p); None: all k.
    """
    _check_shapes(draft_tokens, target_probs)
    if draft_probs.shape != (*draft_tokens.shape, target_probs.shape[-1]):
        raise ValueError(f"`draft_probs` must be [batch, k, vocab] matching target_probs, got "
                         f"{tuple(draft_probs.shape)}")
    index = draft_tokens[..., None]
    p = target_probs[:, :-1].gather(2, index).squeeze(2)  # [batch, k] p_j(x_j)
    q = draft_probs.gather(2, index).squeeze(2)  # [batch, k] q_j(x_j) > 0: x_j was sampled from q_j
    uniform = torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype)
    # q <= p: always accept; else accept with prob p / q  (u * q < p avoids dividing)
    num_accepted = _first_rejection(uniform * q < p, num_drafts)
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    target_at = target_probs[rows, num_accepted]  # [batch, vocab] p at the first rejection (or p_k)
    padded_q = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], dim=1)
    residual = (target_at - padded_q[rows, num_accepted]).clamp_min(0)  # q row is zero at k: bonus draws from p_k
    residual = _normalized(residual, fallback=target_at)
    last = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return _emit(draft_tokens, num_accepted, last)


def _normalized(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # A row whose residual is all zero (p == q up to rounding, reachable only through float error) draws from p.
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(weights.dtype).tiny), fallback)
