"""`eagle_generate` with `eagle_tree` and `compile_config`: EAGLE-2 trees grown by compiled head passes over the
head's paged pool, verified in one compiled target forward, the accepted path moved into place (no cache copies).

The target's side is compiled Medusa's (`target_rounds.TargetRounds` for the prefill and the rows,
`step.tree_verify_step` for the verify, `tree_paths.py` for the greedy walk and the K/V move); the head keeps compiled
EAGLE's pool and entry rule (`eagle_loop.py`: the entry at position t pairs the target's feature at t with the token at
t + 1). A round, row `r` with its last token (the root) at position `p`:
- the head's output at entry `p - 1` (kept from the last catch-up) gives the root's `top_k` children (depth 1);
- growth (`eagle_tree.grow_tree`, the eager loop's rule: expand the `top_k` best nodes of the newest level, rerank
  the pool to the `total_tokens` best): level i's `top_k` entries (each expanded node's parent's output, its token)
  are written to the head's slots `p + i * top_k ..`, computed at position `p + i`, and see the head's entries
  before `p` and, among the round's earlier entries, their ancestors' (the paged tree attention with a `[rows,
  top_k, (i + 1) * top_k]` mask); one compiled pass per level (`tree_level_pass`);
- the target verifies every row's tree (node j at slot `p + j`, position `p + depth(j)`) and returns the head's
  fused features at each node;
- the walk keeps the accepted path and moves its K/V to `p ..`; one compiled head pass (`tree_catch_up`) writes the
  path's entries at `p ..` (each node's feature with the token after it on the path, the target's own choice after
  the last) and reads the output at the row's new last entry: the next round's root children. The round's growth
  entries past it are overwritten before any query can read them.
Greedy output equals plain greedy `generate`, at any batch size. Sampled calls decode eagerly (the entry warns).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..runtime.attention import ATTENTION_NAME, StepAttention
from ..speculative.decoding import GenerateCall
from ..speculative.eagle import EagleOptions
from ..speculative.eagle_head import EagleHead
from ..speculative.eagle_tree import EagleTree, grow_tree, top_children
from .eagle_loop import HeadRounds, compiled_head_pass, head_entries, picked_output
from .paged_rows import table_slots
from .target_rounds import TargetRounds, pool_for
from .step import compiled_tree_verify_step, compiled_with
from .tree_paths import children_lists, greedy_paths, keep_paths


def tree_level_pass(model: PreTrainedModel, head: EagleHead, features: torch.Tensor, tokens: torch.Tensor,
                    positions: torch.Tensor, depth_positions: torch.Tensor, visible: torch.Tensor, kv,
                    block_table: torch.Tensor, attend, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One growth level: row `r` writes the `k` entries (`features` `[rows, k, H]`, `tokens` `[rows, k]`) after the
    round's earlier ones, the round's entries starting at `positions[r]` (`visible` `[rows, k, m]`: the round's `m`
    entries so far, these last, each entry's ancestors and itself), computed at `depth_positions[r]` -> the outputs
    `[rows, k, H]` and each one's `top_k` children (log probabilities, tokens: `[rows, k, top_k]`)."""
    rows, num = tokens.shape
    width = visible.shape[2]
    columns = positions[:, None] + (width - num) + torch.arange(num, device=positions.device)  # [rows, k]
    slots = table_slots(block_table, columns, kv.block_size).reshape(-1)
    query_start = torch.arange(rows + 1, device=positions.device) * num
    attention = StepAttention(kv, slots, block_table, query_start, positions + width, attend, tree_mask=visible)
    at = depth_positions[:, None].expand(rows, num).reshape(1, -1)
    out = head_entries(model, head, features.reshape(1, rows * num, -1), tokens.reshape(1, -1), at, attention, False)
    out = out[0].view(rows, num, -1)
    return out, *top_children(model, head, out, top_k)


def tree_catch_up(model: PreTrainedModel, head: EagleHead, features: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, kv, block_table: torch.Tensor, attend, pick: torch.Tensor,
                  top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted paths' entries (`eagle_loop.head_pass`'s rule, fused target features) -> the head's output at
    entry `pick[r]` `[rows, H]` and its `top_k` children (log probabilities, tokens: `[rows, top_k]`)."""
    hidden = picked_output(model, head, features, tokens, positions, kv, block_table, attend, pick, True)
    return hidden, *top_children(model, head, hidden, top_k)


def compiled_eagle_tree_generate(call: GenerateCall,
                                 options: EagleOptions) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Greedy EAGLE-2 decoding with compiled growth and verify (see the module docstring); returns what `generate`
    returns."""
    model, head, settings = call.model, options.eagle_head, options.eagle_tree
    head.check_compatible(model)
    target = TargetRounds(call, settings.total_tokens, options.eagle_stats, head.config.feature_layers)
    # a round's growth writes (depth - 1) * top_k entries from a row's position, its catch-up depth + 1
    lookahead = max((settings.depth - 1) * settings.top_k, settings.depth)
    pool = pool_for(head, target.prompts, target.outputs.max_new_tokens, lookahead, call.generation_config,
                    head.midlayer.self_attn.config)
    heads = HeadRounds(model, head, pool, target.attends.verify,
                       compiled_head_pass(call.generation_config.compile_config, head, model), 0.0)
    rounds = TreeRounds(target, heads, settings)
    return target.run(rounds.step, rounds.start, (head.attention_implementation(ATTENTION_NAME),))


@dataclass(slots=True)
class TreeRounds:
    """One call's compiled passes and the head's state between rounds: `hidden` `[rows, H]`, the head's output at
    each row's last entry, and `children` (log probabilities, tokens: `[rows, top_k]`), the root's children it
    gives."""

    target: TargetRounds
    heads: HeadRounds
    settings: EagleTree
    hidden: torch.Tensor | None = None
    children: tuple[torch.Tensor, torch.Tensor] | None = None
    level: object = field(init=False)
    catch_up: object = field(init=False)
    verify: object = field(init=False)

    def __post_init__(self) -> None:
        config, model, head = self.target.config.compile_config, self.target.model, self.heads.head
        self.level = compiled_with(config, head, tree_level_pass, companions=(model,))
        self.catch_up = compiled_with(config, head, tree_catch_up, companions=(model,))
        self.verify = compiled_tree_verify_step(config, model)

    def start(self) -> None:
        """After the prefill: the head's entries over the prompts, and the first roots' children."""
        target, heads = self.target, self.heads
        heads.start(target.prompts, target.last, target.features)
        self.hidden = heads.last.hidden
        self.children = top_children(target.model, heads.head, self.hidden, self.settings.top_k)

    def step(self) -> None:
        """One round: grow, verify, walk, emit, move the accepted K/V into place, let the head read the path."""
        target, start = self.target, self.target.positions
        tree, passes = grow_tree(self._expand, self.hidden, target.last, self.children, self.settings)
        predictions, features = self.verify(target.model, tree.tokens, start, tree.depths, tree.ancestors,
                                            target.rows.kv, target.rows.block_table, target.attends.tree,
                                            target.feature_layers)
        drafted = tree.tokens.tolist()
        paths = greedy_paths(children_lists(tree.child_table), drafted, predictions.tolist())
        active = target._active()
        keep_paths(target, paths, drafted, predictions, active)
        self._read_paths(paths, drafted, target.last.tolist(), features, start, tree.depth)
        target.stats.num_draft_forwards += 1 + passes  # the catch-up, then one pass per grown level
        emitted = torch.tensor([len(path) for path in paths])
        target.stats.record_round(tree.depth, emitted - 1, emitted, torch.tensor(active), tree.num_nodes - 1)

    def _expand(self, features: torch.Tensor, tokens: torch.Tensor, index: int,
                visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`grow_tree`'s level step: the compiled `tree_level_pass` over the head's pool."""
        target, heads = self.target, self.heads
        return self.level(target.model, heads.head, features, tokens, target.positions, target.positions + index,
                          visible.contiguous(), heads.pool.kv, heads.pool.block_table, target.attends.tree,
                          self.settings.top_k)

    def _read_paths(self, paths: list[list[int]], drafted: list[list[int]], last: list[int],
                    features: torch.Tensor, start: torch.Tensor, depth: int) -> None:
        """The head's catch-up over each row's accepted path: entries `start .. start + depth` (a path shorter than
        the deepest tree repeats its last node; those entries are overwritten before they are read), read at the
        path's last node."""
        width = depth + 1
        nodes, tokens = [], []
        for r, path in enumerate(paths):
            after = [drafted[r][node] for node in path[1:]] + [last[r]]  # the token after each path node
            nodes.append(path + [path[-1]] * (width - len(path)))
            tokens.append(after + [after[-1]] * (width - len(path)))
        device = features.device
        index = torch.tensor(nodes, device=device)
        picked = features.gather(1, index[..., None].expand(-1, -1, features.shape[-1]))  # [rows, width, F]
        accepted = torch.tensor([len(path) - 1 for path in paths], device=device)
        heads = self.heads
        self.hidden, *children = self.catch_up(self.target.model, heads.head, picked,
                                               torch.tensor(tokens, device=device), start, heads.pool.kv,
                                               heads.pool.block_table, heads.attend, accepted, self.settings.top_k)
        self.children = tuple(children)
