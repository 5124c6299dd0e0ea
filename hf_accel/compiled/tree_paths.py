"""What a compiled tree round does after its verify forward, for Medusa's trees and EAGLE-2's alike: walk each row's
tree greedily, emit the accepted tokens, and move the accepted nodes' K/V into place in the target's pool.

A row's tree was written to the slots from its position (node i at `position + i`, node 0 its last token); its
accepted path (node indices, root first) keeps the root where it is and moves node `path[i]` to `position + i`, so
the pool then holds the row's tokens in order. Rejected nodes' slots are overwritten by later rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .target_rounds import TargetRounds


def greedy_paths(children: Sequence[Sequence[Sequence[int]]], tokens: list[list[int]],
                 predictions: list[list[int]]) -> list[list[int]]:
    """Each row's accepted path of node indices, root first (`children[r][node]`: row r's nodes under `node`): from
    the root, the child whose token is the target's greedy choice at the current node, while one is (a node's
    children hold distinct tokens)."""
    paths = []
    for row_children, row_tokens, row_predictions in zip(children, tokens, predictions):
        path = [0]
        while True:
            chosen = row_predictions[path[-1]]
            child = next((c for c in row_children[path[-1]] if row_tokens[c] == chosen), None)
            if child is None:
                break
            path.append(child)
        paths.append(path)
    return paths


def children_lists(child_table: torch.Tensor) -> list[list[list[int]]]:
    """`[rows, nodes, most children]` (-1 past a node's children) -> row -> node -> its children."""
    return [[[c for c in node if c >= 0] for node in row] for row in child_table.tolist()]


def keep_paths(target: TargetRounds, paths: list[list[int]], tokens: list[list[int]], predictions: torch.Tensor,
               active: list[bool]) -> None:
    """Emit each generating row's accepted tokens (the path's nodes after the root, then the target's choice at its
    last node), move their K/V into place, advance the rows' positions and set their last tokens; `predictions`
    `[rows, nodes]`: the target's greedy choice after each node."""
    chosen = predictions.tolist()
    for r, path in enumerate(paths):
        if active[r]:
            target._emit(r, [tokens[r][node] for node in path[1:]] + [chosen[r][path[-1]]])
    pool = target.rows
    bases = target.positions.tolist()
    moves = [(r, bases[r] + node, bases[r] + i) for r, path in enumerate(paths) if active[r]
             for i, node in enumerate(path) if node != i]  # (row, from position, to position)
    if moves:
        row, source, dest = (torch.tensor(column, device=pool.device) for column in zip(*moves))
        pool.kv.move_slots(pool.slots(row, source), pool.slots(row, dest))
    moved = torch.tensor([len(path) if on else 0 for path, on in zip(paths, active)], device=pool.device)
    target.positions = target.positions + moved
    last_nodes = torch.tensor([path[-1] for path in paths], device=pool.device)
    target.last = predictions.gather(1, last_nodes[:, None]).squeeze(1)
