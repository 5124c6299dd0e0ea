"""The walk of a verified Medusa tree: each row decides tokens from its root down exactly as plain decoding would.

At depth i every row still walking takes the logits of its current node, runs the logits processors on them with
the tokens it has decided so far, and commits the argmax or one multinomial draw; it then descends into the child
that holds that token, or stops (no such child, its budget spent, or a stopping criterion fired on the token, which
is checked after every token). Greedy rows therefore equal plain greedy rows, and sampled tokens are exact draws
from plain decoding's distribution (the candidates are deterministic: following a child whose token was drawn
from the model's own distribution is lossless). Rows walk independently and accept their own numbers of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decoding import TokenRules
from .ragged_batch import RaggedBatch
from .tree import VerifiedTree


@dataclass(slots=True)
class Walk:
    """One round's outcome per row: `tokens` `[batch, depth + 1]` decided (the first `num_emitted[r]` count),
    `nodes` `[batch, depth + 1]` the kept nodes (root first, then the accepted path; 0 past it), `fired`: a
    stopping criterion fired on the row's token `num_to_stop[r]` (1-based); None when no criterion was checked."""

    tokens: torch.Tensor
    nodes: torch.Tensor
    num_emitted: torch.Tensor
    fired: torch.Tensor | None
    num_to_stop: torch.Tensor


def walk_tree(rules: TokenRules, batch: RaggedBatch, tree: VerifiedTree, tokens: torch.Tensor,
              logits: torch.Tensor) -> Walk:
    """Decide each unfinished row's tokens along its tree (one for all rows, or one per row). `tokens`:
    `[batch, num_nodes]` node tokens (the root first), `logits`: `[batch, num_nodes, vocab]` the verification
    forward's logits."""
    rows, device = tokens.shape[0], tokens.device
    decided = tokens.new_full((rows, tree.depth + 1), batch.pad_token_id)
    nodes = torch.zeros_like(decided)
    num_emitted, num_to_stop = torch.zeros_like(batch.num_generated), torch.zeros_like(batch.num_generated)
    fired, walking = None, batch.unfinished  # a new tensor, updated in place
    if tree.depth:  # what the descent needs (a root-only tree is a plain step)
        node, every_row = torch.zeros_like(num_emitted), torch.arange(rows, device=device)
        children = tree.child_table.to(device)  # one table for every row, or one per row (EAGLE-2 trees)
        children = children.expand(rows, -1, -1) if children.dim() == 2 else children
        budget = batch.remaining
    for depth in range(tree.depth + 1):
        walkers = walking.nonzero().squeeze(1)
        if walkers.numel() == 0:
            break
        raw = (logits[:, 0] if depth == 0 else logits[every_row, node]).to(dtype=torch.float32, copy=True)
        scores = _process(rules, batch, decided, depth, raw, walkers)
        token = _choose(rules, scores, walkers, decided[:, depth])
        decided[:, depth] = token
        num_emitted += walking
        rules.collect(scores[:, None], raw[:, None], walkers)
        stop = _stops(rules, batch, decided, depth, scores, walking, fired)
        if stop is not None:
            fired = stop if fired is None else fired | stop
            num_to_stop = torch.where(stop, depth + 1, num_to_stop)
        if depth == tree.depth:  # the deepest nodes have no children
            break
        ended = num_emitted >= budget if stop is None else (num_emitted >= budget) | (stop & batch.pad_finished)
        node = _descend(children[every_row, node], tokens, token, node, walking, ended)
        nodes[:, depth + 1] = torch.where(walking, node, 0)
    return Walk(decided, nodes, num_emitted, fired, num_to_stop)


def _descend(candidates: torch.Tensor, tokens: torch.Tensor, token: torch.Tensor, node: torch.Tensor,
             walking: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
    """Each walking row's child of `node` (its children: `candidates` `[batch, max_children]`, -1 past them) that
    holds its decided `token`; rows with no such child or `ended` stop walking (`walking` is updated in place) and
    keep `node`."""
    match = (candidates >= 0) & (tokens.gather(1, candidates.clamp_min(0)) == token[:, None])
    child = candidates.gather(1, match.long().argmax(dim=1, keepdim=True)).squeeze(1)
    walking &= ~(ended | ~match.any(dim=1))
    return torch.where(walking, child, node)


def _process(rules: TokenRules, batch: RaggedBatch, decided: torch.Tensor, depth: int, raw: torch.Tensor,
             walkers: torch.Tensor) -> torch.Tensor:
    """Processed scores `[batch, vocab]` of the walking rows (the others keep `raw`). Processors see the whole batch
    (some keep per-row state), once per distinct row length, cut to that length: the rows of that length then look
    exactly as in plain decoding (no extra padding), and only their scores are kept."""
    if len(rules.processors) == 0:
        return raw
    history = batch.with_candidates(decided[:, :depth])
    lengths = batch.history_lengths + depth
    scores = raw.clone()
    for length in lengths[walkers].unique().tolist():
        group = walkers[lengths[walkers] == length]
        cut = torch.full_like(lengths, length)
        group_scores = rules.process(batch.view(history, cut), raw.clone(), cut)
        scores[group] = group_scores[group]
    return scores


def _choose(rules: TokenRules, scores: torch.Tensor, walkers: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # the walking rows' tokens (the others keep `fallback`)
    every = walkers.numel() == scores.shape[0]
    chosen = rules.choose(scores if every else scores[walkers])
    return chosen if every else fallback.index_copy(0, walkers, chosen)


def _stops(rules: TokenRules, batch: RaggedBatch, decided: torch.Tensor, depth: int, scores: torch.Tensor,
           walking: torch.Tensor, fired: torch.Tensor | None) -> torch.Tensor | None:
    """`[batch]` bool: a stopping criterion fires on the token just decided (checked on walking rows that have not
    stopped, now or before); None when there is no criterion to check."""
    if not rules.has_stops:
        return None
    checked = walking & ~batch.stopped if fired is None else walking & ~batch.stopped & ~fired
    return rules.fires(batch, decided[:, : depth + 1], scores, checked)
