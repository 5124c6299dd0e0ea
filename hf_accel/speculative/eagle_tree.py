"""EAGLE-2's dynamic draft tree: grown by the head each round, one tree per row, verified in one target forward.

Growth (per row, all rows at once): the head's output at the root gives the `top_k` best first tokens, each scored
by its log probability. Then `depth - 1` head passes: each expands the `top_k` best nodes of the newest level (by
cumulative log probability, the product of the draft probabilities along the path) into their `top_k` best
children, so the pool holds `top_k` nodes at depth 1 and `top_k ** 2` at each deeper level. The tree verified is
the `total_tokens` best nodes of the whole pool (rerank). A child never scores above its parent, and ties keep the
shallower node first, so the chosen nodes always include every chosen node's parent: the tree is prefix-closed. For
the same reason growth stops early, with the same tree, once no row's newest level beats its `total_tokens`-th best
node (`_settled`).

A pass appends its `top_k` entries to the head's cache after the target entries; an entry sees the row's real
target slots, the entries of its ancestors (earlier passes) and itself. `HeadState.drop_drafts` removes them all
once the round is verified.

Verification reuses the Medusa machinery (`tree_cache.tree_masks`, `medusa_walk.walk_tree`,
`tree_cache.keep_tree_path`) with per-row tensors: `DraftTree` has the fields a `MedusaTree` offers them, each with a
leading batch dimension. The candidates are deterministic given the head, so the walk (the target decides each token
as plain decoding would, then follows the child holding it) is exact for greedy and lossless for sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .eagle_draft import HeadState
from .eagle_head import EagleHead
from .ragged_batch import RaggedBatch


@dataclass(frozen=True, slots=True)
class EagleTree:
    """How `eagle_generate` grows EAGLE-2 trees (`eagle_tree=hf_accel.EagleTree(...)`).

    total_tokens: candidates verified per round (the tree's nodes besides the root).
    depth: the deepest draft (head passes per round: `depth - 1` after the catch-up pass).
    top_k: nodes expanded per level, and children read per expanded node.
    """

    total_tokens: int = 10
    depth: int = 5
    top_k: int = 4

    def __post_init__(self) -> None:
        for name in ("total_tokens", "depth", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EagleTree `{name}` must be an integer >= 1, got {value!r}")

    @property
    def pool_size(self) -> int:
        """Nodes grown per row before the rerank: `top_k` at depth 1, `top_k ** 2` at each deeper level."""
        return self.top_k + (self.depth - 1) * self.top_k**2


@dataclass(frozen=True, slots=True)
class DraftTree:
    """One verified tree per row, node 0 the root, parents before children (what `walk_tree` / `tree_masks` read).

    `tokens`, `depths`, `scores` (cumulative draft log probability, 0 at the root): `[batch, num_nodes]`; `ancestors`:
    `[batch, num_nodes, num_nodes]` bool, row j true at j's ancestors and j itself; `child_table`: `[batch, num_nodes,
    max_children]`, -1 past a node's children; `depth`: the deepest node of any row.
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    ancestors: torch.Tensor
    child_table: torch.Tensor
    depth: int

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass(slots=True)
class _Pool:
    """The nodes grown so far, per row, in growth order (a parent before its children): `[batch, n]` each."""

    tokens: torch.Tensor
    scores: torch.Tensor  # cumulative draft log probability
    parents: torch.Tensor  # pool index of the parent, -1 under the root
    depths: torch.Tensor

    def add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depth: int) -> int:
        """Append a level; returns the pool index of its first node."""
        start = self.tokens.shape[1]
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.scores = torch.cat([self.scores, scores], dim=1)
        self.parents = torch.cat([self.parents, parents], dim=1)
        self.depths = torch.cat([self.depths, torch.full_like(tokens, depth)], dim=1)
        return start


# one level of growth: (features [batch, k, H], tokens [batch, k], level index i for nodes at depth i + 1, visible
# [batch, k, m] bool over the level's and earlier levels' entries) -> (the entries' outputs [batch, k, H], and each
# entry's top_k children: log probabilities [batch, k, top_k] and tokens [batch, k, top_k])
Expand = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def top_children(model: PreTrainedModel, head: EagleHead, hidden: torch.Tensor,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top_k` best next tokens from the head's outputs `hidden` `[..., H]` -> their log probabilities and the
    tokens, `[..., top_k]` each."""
    return torch.log_softmax(head.logits(model, hidden), dim=-1).topk(top_k, dim=-1)


def grow_tree(expand: Expand, hidden: torch.Tensor, roots: torch.Tensor,
              root_children: tuple[torch.Tensor, torch.Tensor],
              settings: EagleTree) -> tuple[DraftTree, int]:
    """Grow each row's tree from the head's output at its root, `hidden` `[batch, H]`, whose `top_k` children
    `root_children` (log probabilities, tokens: `[batch, k]`) are depth 1, one `expand` per deeper level; returns the
    tree (rooted at `roots` `[batch]`, each row's newest token) and the number of head passes run (the catch-up's
    not counted)."""
    k = settings.top_k
    scores, tokens = root_children
    pool = _Pool(tokens, scores, torch.full_like(tokens, -1), torch.ones_like(tokens))
    features = hidden[:, None].expand(-1, k, -1)  # each expanded node's entry reads its parent's output
    indices = torch.arange(k, device=tokens.device).expand_as(tokens)  # pool indices of the expanded nodes
    visible = torch.eye(k, dtype=torch.bool, device=tokens.device).expand(tokens.shape[0], k, k)
    for level in range(1, settings.depth):
        out, child_scores, child_tokens = expand(features, tokens, level - 1, visible)  # [batch, k, H / k]
        child_scores = (scores[:, :, None] + child_scores).flatten(1)  # [batch, k * k], parent-major
        start = pool.add(child_tokens.flatten(1), child_scores, indices.repeat_interleave(k, dim=1), level + 1)
        if level + 1 == settings.depth or _settled(pool, child_scores, settings.total_tokens):
            return _tree_from_pool(pool, roots, settings.total_tokens), level
        pick = child_scores.topk(k, dim=-1).indices  # [batch, k]: the level's best nodes, expanded next
        parent = pick // k  # which of this pass's entries each one's parent is
        features = out.gather(1, parent[..., None].expand(-1, -1, out.shape[-1]))
        tokens, scores = pool.tokens[:, start:].gather(1, pick), child_scores.gather(1, pick)
        indices = start + pick
        ancestors = visible.gather(1, parent[..., None].expand(-1, -1, visible.shape[-1]))
        own = torch.eye(k, dtype=torch.bool, device=tokens.device).expand(len(pick), k, k)
        visible = torch.cat([ancestors, own], 2)
    return _tree_from_pool(pool, roots, settings.total_tokens), 0  # depth 1: no pass


def eager_expand(state: HeadState, model: PreTrainedModel, batch: RaggedBatch, top_k: int) -> Expand:
    """`grow_tree`'s level step for the eager loop: the head's entries appended to its DynamicCache
    (`HeadState.tree_step`), their children read out eagerly."""
    def expand(features: torch.Tensor, tokens: torch.Tensor, index: int, visible: torch.Tensor):
        out = state.tree_step(model, batch, features, tokens, index, visible)
        return out, *top_children(model, state.head, out, top_k)

    return expand


def _settled(pool: _Pool, newest: torch.Tensor, total_tokens: int) -> bool:
    """True when growing further cannot change any row's tree: the best score of the newest level (`[batch, n]`),
    which bounds every descendant's, is no better than the row's `total_tokens`-th best in the pool (a descendant
    that ties it ranks after it: it was grown later)."""
    if pool.scores.shape[1] < total_tokens:
        return False
    cut = pool.scores.topk(total_tokens, dim=1).values[:, -1]  # [batch]
    return bool((newest.max(dim=1).values <= cut).all())


def _tree_from_pool(pool: _Pool, roots: torch.Tensor, total_tokens: int) -> DraftTree:
    """The `total_tokens` best nodes of each row's pool as a `DraftTree` rooted at `roots` `[batch]`."""
    rows, size = pool.tokens.shape
    n = min(total_tokens, size)
    order = torch.sort(pool.scores, dim=1, descending=True, stable=True).indices  # ties: the shallower first
    chosen = order[:, :n].sort(dim=1).values  # growth order: parents before children
    numbers = torch.arange(1, n + 1, device=roots.device).expand(rows, n).clone()
    node_of = torch.full_like(pool.tokens, -1).scatter_(1, chosen, numbers)
    pool_parent = pool.parents.gather(1, chosen)
    parents = torch.where(pool_parent >= 0, node_of.gather(1, pool_parent.clamp_min(0)), 0)  # [rows, n], 0: root
    parents = torch.cat([parents.new_full((rows, 1), -1), parents], dim=1)  # [rows, n + 1]
    tokens = torch.cat([roots[:, None], pool.tokens.gather(1, chosen)], dim=1)
    depths = torch.cat([pool.depths.new_zeros(rows, 1), pool.depths.gather(1, chosen)], dim=1)
    scores = torch.cat([pool.scores.new_zeros(rows, 1), pool.scores.gather(1, chosen)], dim=1)
    return DraftTree(tokens, depths, scores, _ancestors(parents), _child_table(parents), int(depths.max()))


def _ancestors(parents: torch.Tensor) -> torch.Tensor:
    # parents come before children: row j = row parent(j) plus j itself. parents: [rows, nodes] -> [rows, nodes, nodes]
    rows, nodes = parents.shape
    ancestors = torch.eye(nodes, dtype=torch.bool, device=parents.device).repeat(rows, 1, 1)
    every_row = torch.arange(rows, device=parents.device)
    for node in range(1, nodes):
        ancestors[:, node] |= ancestors[every_row, parents[:, node]]
    return ancestors


def _child_table(parents: torch.Tensor) -> torch.Tensor:
    # [rows, nodes, most children]: each node's children in node order, -1 past them
    nodes = parents.shape[1]
    index = torch.arange(nodes, device=parents.device)
    is_child = parents[:, None, :] == index[:, None]  # [rows, node, candidate child]
    table = torch.where(is_child, index, nodes).sort(dim=-1).values
    width = max(1, int(is_child.sum(dim=-1).max()))
    return table[..., :width].masked_fill(table[..., :width] == nodes, -1)
