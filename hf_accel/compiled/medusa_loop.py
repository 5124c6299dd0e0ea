"""`medusa_generate` with `compile_config`: each round's tree verified in one compiled forward over a static paged
pool, the accepted path moved into place in the pool (no crop, no copy of the cache).

The prompts are prefilled packed (`target_rounds.TargetRounds`, which also keeps the rows' positions, last tokens and
outputs). A round, greedy:
- the drafter (the heads) reads each row's last hidden state (at its last verified token) and drafts the round's
  tree: the whole candidate tree, or the prefix `TreeSizer` picks (`medusa.trees_for`, as in the eager loop); the
  heads and their top-k run compiled too (`draft_tree`);
- ONE compiled forward (`step.tree_verify_step`) verifies every row's tree: node i is written to the row's slot
  `position + i` and computed at `position + depth(i)`, attending to the context and its ancestors through the paged
  tree attention (`paged_tree_attention` on CPU, `decode_attention`'s tree rule elsewhere);
- the walk follows, from the root, the child whose token is the target's greedy choice at its parent; the row emits
  the accepted tokens and the target's choice after the last;
- the accepted nodes' K/V move to slots `position + 1 ..` (`KVPool.move_slots`); rejected nodes' slots are
  overwritten by later rounds (`tree_paths.py`: the walk and the move, shared with compiled EAGLE-2 trees).
Greedy output equals plain greedy `generate`, at any batch size (left-padded prompts are packed without their
padding). Sampled calls decode eagerly (`speculative_entry.py` warns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..speculative.decoding import GenerateCall
from ..speculative.medusa import MedusaOptions, TreeChoice
from ..speculative.medusa_heads import MedusaHeads
from ..speculative.tree import MedusaTree, candidate_tokens
from .step import compiled_tree_verify_step, compiled_with
from .target_rounds import TargetRounds
from .tree_paths import greedy_paths, keep_paths


def compiled_medusa_generate(call: GenerateCall,
                             options: MedusaOptions) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Greedy Medusa decoding with a compiled tree verify (see the module docstring); returns what `generate`
    returns."""
    trees, heads = options.trees, options.medusa_heads
    heads.check_compatible(call.model)
    target = TargetRounds(call, trees.whole.num_nodes - 1, options.medusa_stats, feature_layers=(-1,))
    rounds = MedusaRounds(target, heads, trees)
    return target.run(rounds.step, rounds.start)


@dataclass(slots=True)
class MedusaRounds:
    """The heads, the trees and the compiled verify of one call; `hidden` `[rows, H]`: each row's hidden state at
    its last verified token (what the heads read next)."""

    target: TargetRounds
    heads: MedusaHeads
    trees: TreeChoice
    hidden: torch.Tensor | None = None
    verify: object = field(init=False)
    draft: object = field(init=False)

    def __post_init__(self) -> None:
        config = self.target.config.compile_config
        self.verify = compiled_tree_verify_step(config, self.target.model)
        self.draft = compiled_with(config, self.heads, draft_tree)

    def start(self) -> None:
        """After the prefill: each row's hidden state at its last prompt token (the packed features)."""
        lengths = self.target.rows.prompt_lengths
        self.hidden = self.target.features[0, lengths.cumsum(0) - 1]

    def step(self) -> None:
        """One round: draft, verify, walk, emit, move the accepted K/V into place."""
        started, target = time.perf_counter(), self.target
        index = self.trees.choose(len(target.prompts))
        tree = self.trees.trees[index]
        tokens = self._tree_tokens(tree)  # [rows, n]
        rows, device = tokens.shape[0], tokens.device
        mask = tree.ancestors.to(device).expand(rows, -1, -1)
        predictions, hidden = self.verify(target.model, tokens, target.positions, tree.depths.to(device), mask,
                                          target.rows.kv, target.rows.block_table, target.attends.tree)
        drafted = tokens.tolist()
        paths = greedy_paths([tree.children] * rows, drafted, predictions.tolist())
        active, remaining = target._active(), target.outputs.remaining
        keep_paths(target, paths, drafted, predictions, active)
        last_nodes = torch.tensor([path[-1] for path in paths], device=device)
        self.hidden = hidden[torch.arange(rows, device=device), last_nodes]
        self._record(index, paths, active, remaining, time.perf_counter() - started)

    def _tree_tokens(self, tree: MedusaTree) -> torch.Tensor:
        """`[rows, n]`: each row's last token (the root), then the candidates its heads draft."""
        root = self.target.last[:, None]
        if tree.num_nodes == 1:
            return root
        device = root.device
        candidates = self.draft(self.heads, self.hidden, tree.candidate_heads.to(device),
                                  tree.candidate_ranks.to(device), tree.depth, tree.max_rank)
        return torch.cat([root, candidates], dim=1)

    def _record(self, index: int, paths: list[list[int]], active: list[bool], remaining: list[int],
                seconds: float) -> None:
        """Count the round in the stats; time it for the sizer with what each generating row accepted and had
        `remaining` before it (as the eager loop does)."""
        tree, stats = self.trees.trees[index], self.target.stats
        stats.num_draft_forwards += int(tree.num_nodes > 1)  # the heads ran
        emitted = torch.tensor([len(path) for path in paths])
        stats.record_round(tree.depth, emitted - 1, emitted, torch.tensor(active), tree.num_nodes - 1)
        if self.trees.sizer is None:
            return
        num_rows = len(active)
        if tree.num_nodes == 1:  # a plain round accepts no candidates
            self.trees.sizer.record(index, [], seconds, num_rows)
            return
        generating, ranks = [r for r, on in enumerate(active) if on], self.trees.ranks[index]
        self.trees.sizer.record(index, [[ranks[node] for node in paths[r][1:]] for r in generating], seconds,
                                num_rows, [remaining[r] for r in generating])


def draft_tree(heads: MedusaHeads, hidden: torch.Tensor, candidate_heads: torch.Tensor,
               candidate_ranks: torch.Tensor, depth: int, max_rank: int) -> torch.Tensor:
    """The candidates of a tree (`MedusaTree.candidate_tokens`, from its `candidate_heads` / `candidate_ranks`,
    `depth` and `max_rank`) that `heads` draft from `hidden` `[rows, H]` -> `[rows, num_nodes - 1]`; compiled
    whole, the heads' weights frozen into the graph like the target's."""
    logits = heads(hidden.to(heads.lm_heads[0].weight.dtype), depth)  # [depth, rows, vocab]
    return candidate_tokens(logits, candidate_heads, candidate_ranks, depth, max_rank)
