"""Medusa candidate trees: which top-k tokens of which heads are verified together, and how they attend.

A tree is a list of paths; path `(i0, i1, ..., id)` is the candidate whose token is the `i0`-th best of head 0, whose
parent is the node `(i0, ..., i(d-1))`, and so on: its token is the `id`-th best of head `d`. Node 0 is the root, the
token already chosen from the base model's logits; node `j >= 1` is path `paths[j - 1]`, sorted by depth then by
path, so every parent comes before its children. A node at depth d sits at sequence position `n + d` when the root
is at `n`, and attends to the prefix, its ancestors and itself.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# A sparse tree for 4 heads in the spirit of Medusa's: the paths most likely to be accepted when head k's top-1 is
# right more often than its top-2, and shallow heads more often than deep ones. 26 candidates + the root.
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (0, 0, 0), (1, 0), (2,), (0, 2), (0, 0, 1), (0, 3), (3,), (0, 1, 0), (2, 0),
    (4,), (0, 0, 2), (0, 4), (1, 1), (1, 0, 0), (0, 0, 0, 0), (5,), (0, 0, 3), (0, 5), (0, 2, 0), (3, 0),
    (0, 1, 1), (0, 0, 0, 1),
)


class VerifiedTree(Protocol):
    """What verifying a tree reads (`tree_attention_mask`, `medusa_walk.walk_tree`): a `MedusaTree`, one tree for
    every row, or an EAGLE-2 `eagle_tree.DraftTree`, one per row (each tensor then has a leading batch dimension)."""

    depths: torch.Tensor  # [(batch,) num_nodes]
    ancestors: torch.Tensor  # [(batch,) num_nodes, num_nodes] bool
    child_table: torch.Tensor  # [(batch,) num_nodes, max_children], -1 past a node's children
    depth: int

    @property
    def num_nodes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MedusaTree:
    """A validated candidate tree with its derived index tensors (built by `build_tree`).

    `paths[j - 1]` is node j; `depths`: `[num_nodes]` (root 0); `parents[j]`: node j's parent (-1 for the root);
    `children[j]`: node j's children in node order; `child_table`: the same as a tensor
    `[num_nodes, max_children]` padded with -1; `ancestors`: `[num_nodes, num_nodes]` bool, row j true at j's
    ancestors and j itself; node j >= 1 is the `candidate_ranks[j - 1]`-th best token of head
    `candidate_heads[j - 1]` (its depth minus one); `depth` and `max_rank` are the heads and top-k the tree needs.
    """

    paths: tuple[tuple[int, ...], ...]
    depths: torch.Tensor  # [num_nodes] long
    parents: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    child_table: torch.Tensor  # [num_nodes, max(1, most children)] long, -1 past a node's children
    ancestors: torch.Tensor  # [num_nodes, num_nodes] bool
    candidate_heads: torch.Tensor  # [num_nodes - 1] head that drafts node j + 1
    candidate_ranks: torch.Tensor  # [num_nodes - 1] its rank in that head's top-k
    depth: int  # deepest level (heads used); 0 for the root alone
    max_rank: int  # top-k needed from any head (0 for the root alone)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    def candidate_tokens(self, head_logits: torch.Tensor) -> torch.Tensor:
        """`head_logits`: `[num_heads, ..., vocab]` -> token ids of nodes 1.. `[..., num_nodes - 1]`."""
        return candidate_tokens(head_logits, self.candidate_heads.to(head_logits.device),
                                self.candidate_ranks.to(head_logits.device), self.depth, self.max_rank)


def candidate_tokens(head_logits: torch.Tensor, candidate_heads: torch.Tensor, candidate_ranks: torch.Tensor,
                     depth: int, max_rank: int) -> torch.Tensor:
    """A tree's candidates from its heads' logits `[num_heads, ..., vocab]`: node j + 1 is rank
    `candidate_ranks[j]` of head `candidate_heads[j]` -> `[..., num_nodes - 1]` (tensors only: traceable)."""
    top = head_logits[:depth].topk(max_rank, dim=-1).indices  # [depth, ..., max_rank]
    return top[candidate_heads, ..., candidate_ranks].movedim(0, -1)


def build_tree(paths: Sequence[Sequence[int]], num_heads: int) -> MedusaTree:
    """Validate `paths` (the `medusa_tree` argument) for heads `num_heads` deep and derive the tree's tensors.

    Raises `ValueError` naming `medusa_tree` for an empty tree, an empty or negative path, a duplicate, a path deeper
    than `num_heads`, or a path whose parent path is missing.
    """
    if not paths:
        raise ValueError("`medusa_tree` must hold at least one path, got an empty tree")
    clean = [tuple(int(i) for i in path) for path in paths]
    for path in clean:
        if not path or min(path) < 0:
            raise ValueError(f"`medusa_tree` paths must be non-empty tuples of ranks >= 0, got {path}")
        if len(path) > num_heads:
            raise ValueError(f"`medusa_tree` path {path} is deeper than the {num_heads} Medusa heads")
    if len(set(clean)) != len(clean):
        raise ValueError("`medusa_tree` holds a path twice")
    known = set(clean)
    missing = [p for p in clean if p[:-1] and p[:-1] not in known]
    if missing:
        raise ValueError(f"`medusa_tree` path {missing[0]} lacks its parent path {missing[0][:-1]}")
    return _make_tree(clean)


def root_only_tree() -> MedusaTree:
    """The tree of no candidates: verifying it is a plain decoding step (the heads need not run)."""
    return _make_tree([])


def _make_tree(paths: list[tuple[int, ...]]) -> MedusaTree:
    ordered = tuple(sorted(paths, key=lambda p: (len(p), p)))
    node_of = {(): 0} | {path: j + 1 for j, path in enumerate(ordered)}
    parents = (-1, *(node_of[p[:-1]] for p in ordered))
    children = tuple(tuple(j for j, parent in enumerate(parents) if parent == node) for node in range(len(parents)))
    width = max(1, *(len(c) for c in children))
    return MedusaTree(
        paths=ordered,
        depths=torch.tensor([0, *(len(p) for p in ordered)], dtype=torch.long),
        parents=parents,
        children=children,
        child_table=torch.tensor([list(c) + [-1] * (width - len(c)) for c in children], dtype=torch.long),
        ancestors=_ancestor_matrix(parents),
        candidate_heads=torch.tensor([len(p) - 1 for p in ordered], dtype=torch.long),
        candidate_ranks=torch.tensor([p[-1] for p in ordered], dtype=torch.long),
        depth=max((len(p) for p in ordered), default=0),
        max_rank=max((p[-1] + 1 for p in ordered), default=0),
    )


def sparse_tree(rank_accuracy: torch.Tensor, num_candidates: int) -> list[tuple[int, ...]]:
    """The `num_candidates` paths most likely to be accepted (Medusa's sparse-tree construction).

    `rank_accuracy[k, i]`: how often head k's i-th best token was the right one (measured on the model's own
    greedy output). A path's value is the product of its ranks' accuracies; since a child is worth at most its
    parent, taking paths best-first keeps the tree prefix-closed.
    """
    if num_candidates < 1:
        raise ValueError(f"`num_candidates` must be >= 1, got {num_candidates}")
    accuracy = rank_accuracy.double().tolist()  # [heads, ranks]
    frontier = [(-accuracy[0][i], (i,)) for i in range(len(accuracy[0]))]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_candidates:
        value, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(accuracy):
            for i, rate in enumerate(accuracy[len(path)]):
                heapq.heappush(frontier, (value * rate, (*path, i)))
    return chosen


def _ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    # parents come before children, so row j = row parent(j) plus j itself
    num = len(parents)
    mask = torch.zeros(num, num, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    return mask


def tree_attention_mask(
    tree: VerifiedTree, prefix_positions: torch.Tensor, root_position: int, sliding_window: int | None = None
) -> torch.Tensor:
    """Which keys each tree node may attend to: `[num_nodes, num_prefix + num_nodes]` bool.

    `prefix_positions`: `[..., num_prefix]` sequence index of each cached key the layer returns (-1 for a padding
    key or a hole), one row per batch row when batched (the result is then `[..., num_nodes, num_prefix + num_nodes]`);
    keys then continue with the tree nodes in node order. `tree` is one tree for every row (`MedusaTree`: `depths`
    `[num_nodes]`, `ancestors` `[num_nodes, num_nodes]`) or one per row (`eagle_tree.DraftTree`: the same with a
    leading batch dimension). Rule: causal over the prefix (every cached key precedes the root), tree ancestors and
    self among the nodes, and with `sliding_window` only keys whose sequence index is greater than the query's minus
    the window (the query at depth d has index `root_position + d`).
    """
    depths = tree.depths.to(prefix_positions.device)  # [..., num_nodes]
    keys = prefix_positions.unsqueeze(-2)  # [..., 1, num_prefix]
    prefix = (keys >= 0).expand(*keys.shape[:-2], tree.num_nodes, keys.shape[-1])
    nodes = tree.ancestors.to(prefix_positions.device)
    if sliding_window is not None:
        prefix = prefix & (keys > (root_position + depths - sliding_window).unsqueeze(-1))
        nodes = nodes & ((depths.unsqueeze(-1) - depths.unsqueeze(-2)) < sliding_window)
    return torch.cat([prefix, nodes.expand(*prefix.shape[:-1], tree.num_nodes)], dim=-1)


def tree_position_ids(tree: MedusaTree, root_position: int) -> torch.Tensor:
    """Depth-based position ids of the nodes, `[1, num_nodes]`: the root's position plus each node's depth."""
    return (root_position + tree.depths).unsqueeze(0)
