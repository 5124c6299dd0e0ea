"""`medusa_generate`: tree speculative decoding with Medusa heads, as a `custom_generate` callable for `generate`.

    out = model.generate(**inputs, custom_generate=hf_accel.medusa_generate, medusa_heads=heads, max_new_tokens=64)

Each round: the drafter (the heads) reads each row's last hidden state and drafts a tree of candidates (top-k per
head, `medusa_tree` paths); ONE forward verifies every row's root token and candidates with a 4-D tree mask and
depth-based positions; the walk (`medusa_walk`) then decides each row's tokens exactly as plain decoding would, so
greedy output equals plain greedy output, sampling draws from exactly the plain distribution, and nothing overshoots
a stop. The cache then keeps each row's accepted path. Rows accept different numbers of tokens: as in
`draft_generate`, a row that accepted fewer than the most gets holes (`RaggedBatch`). By default the tree verified
is the prefix of the best-first candidate list with the best expected tokens per second for the whole batch
(`tree_size.TreeSizer`, priced by the measured `round_cost.RoundCost`; size 0 is a plain round).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.paged import PagedCache
from .decoding import Decoding, GenerateCall
from .medusa_heads import MedusaHeads
from .medusa_walk import Walk, walk_tree
from .stats import SpeculativeStats
from .tree import DEFAULT_TREE, MedusaTree, build_tree, root_only_tree
from .tree_cache import LayerGroup, keep_tree_path, layer_groups, prepare_tree_cache, tree_masks
from .tree_size import TreeSizer, prefix_sizes

__all__ = ["medusa_generate"]


@dataclass(frozen=True, slots=True)
class TreeChoice:
    """The trees a call may verify: prefixes of the best-first candidate list (just the whole list when the size is
    fixed), `ranks[i][j]` the best-first rank of node j of `trees[i]` (-1 for the root), and the sizer choosing."""

    trees: tuple[MedusaTree, ...]
    ranks: tuple[tuple[int, ...], ...]
    sizer: TreeSizer | None

    @property
    def whole(self) -> MedusaTree:
        return self.trees[-1]

    def choose(self, batch_size: int) -> int:
        """Index into `trees` of the one the next round of `batch_size` rows verifies."""
        return self.sizer.choose(batch_size) if self.sizer is not None else len(self.trees) - 1


@dataclass(slots=True)
class MedusaOptions:
    """`medusa_generate`'s own arguments (see its docstring), checked (`ValueError` naming the wrong one), with the
    trees the call may verify."""

    medusa_heads: MedusaHeads | None
    medusa_tree: Sequence[Sequence[int]] | None
    medusa_stats: SpeculativeStats | None
    medusa_adaptive: bool | None
    trees: TreeChoice = field(init=False)

    def __post_init__(self) -> None:
        self.trees = trees_for(self.medusa_heads, self.medusa_tree, self.medusa_adaptive)


@dataclass(slots=True)
class _Run:
    """One `medusa_generate` call: the loop's state, the model, its heads and trees, its cache."""

    decoding: Decoding
    model: PreTrainedModel
    heads: MedusaHeads
    trees: TreeChoice
    cache: Cache
    groups: list[LayerGroup]


def medusa_generate(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                    stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                    medusa_heads: MedusaHeads | None = None, medusa_tree: Sequence[Sequence[int]] | None = None,
                    medusa_stats: SpeculativeStats | None = None, medusa_adaptive: bool | None = None,
                    hf_accel_streamer: BaseStreamer | None = None,
                    **model_kwargs) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Decode with Medusa heads; called by `model.generate(..., custom_generate=medusa_generate, medusa_heads=...)`.

    Args (beyond what generate passes):
        medusa_heads: trained `MedusaHeads` for this model (hidden size and vocab must match).
        medusa_tree: candidate paths, best first (see `hf_accel.speculative.tree`); default: the heads' calibrated
            `config.tree`, else `DEFAULT_TREE` cut to the heads' depth.
        medusa_stats: a `SpeculativeStats` to fill with tokens per forward and acceptance per depth.
        medusa_adaptive: verify each round the prefix of the candidate list with the best expected tokens per
            second (`hf_accel.speculative.tree_size`) rather than the whole tree. Default: True for the default
            tree, False for an explicit `medusa_tree`. Output is the same either way.
        hf_accel_streamer: set by hf_accel's generate hook from `streamer=` (stock generate drops it for callables).
    Any batch size (left-padded rows, `num_return_sequences`), no beams; batch size > 1 needs an empty DynamicCache,
    full-attention layers and no streamer. Returns what `_sample` returns: `sequences` `[batch, prompt + new]`
    (finished rows padded with `pad_token_id`), or a `GenerateDecoderOnlyOutput` with `scores` / `logits` /
    `past_key_values` (at batch size > 1 holding holes, see `RaggedBatch`: not to be continued from).
    """
    options = MedusaOptions(medusa_heads, medusa_tree, medusa_stats, medusa_adaptive)
    call = GenerateCall(model, input_ids.to(model.device), logits_processor, stopping_criteria, generation_config,
                        hf_accel_streamer, model_kwargs)
    run = _start(call, options)
    run.decoding.run(lambda: _prefill(run), lambda hidden: _round(run, hidden), (model, medusa_heads))
    return run.decoding.output(generation_config, run.cache if generation_config.use_cache else None)


def trees_for(heads: MedusaHeads | None, paths: Sequence[Sequence[int]] | None, adaptive: bool | None) -> TreeChoice:
    """The trees a call verifies, from its `medusa_heads`, `medusa_tree` and `medusa_adaptive` (validated; see
    `medusa_generate`)."""
    if heads is None:
        raise ValueError("medusa_generate needs `medusa_heads=` (a hf_accel.MedusaHeads trained for this model)")
    adaptive = paths is None if adaptive is None else bool(adaptive)
    if paths is None:
        paths = heads.config.tree or [path for path in DEFAULT_TREE if len(path) <= heads.num_heads]
    whole = build_tree(paths, heads.num_heads)  # validates `medusa_tree`
    ordered = [tuple(int(i) for i in path) for path in paths]  # best first, as given
    sizes = prefix_sizes(ordered) if adaptive else (len(ordered),)
    trees = tuple(build_tree(ordered[:size], heads.num_heads) if size else root_only_tree() for size in sizes[:-1])
    trees += (whole,)
    rank_of = {path: rank for rank, path in enumerate(ordered)}
    ranks = tuple((-1, *(rank_of[path] for path in tree.paths)) for tree in trees)
    return TreeChoice(trees, ranks, TreeSizer(sizes) if len(sizes) > 1 else None)


def _start(call: GenerateCall, options: MedusaOptions) -> _Run:
    model, heads = call.model, options.medusa_heads
    heads.check_compatible(model)
    cache = call.model_kwargs.get("past_key_values")
    cache = DynamicCache(config=model.config) if cache is None else cache
    groups = layer_groups(model.config)
    _check_batch(call.generation_config, call.input_ids, cache, groups, call.streamer)
    prepare_tree_cache(cache)
    return _Run(Decoding.start(call, options.medusa_stats), model, heads, options.trees, cache, groups)


def _check_batch(config: GenerationConfig, input_ids: torch.Tensor, cache: Cache, groups: list[LayerGroup],
                 streamer: BaseStreamer | None) -> None:
    """Refuse by name what medusa_generate does not support (beams; at batch size > 1 what holes would break)."""
    if config.num_beams > 1:
        raise ValueError(f"medusa_generate does not support beam search: `num_beams` is {config.num_beams}")
    rows = input_ids.shape[0]
    if rows == 1:
        return
    if streamer is not None:
        raise ValueError(f"`streamer` supports batch size 1 only; `input_ids` has batch size {rows}")
    if any(group.sliding_window is not None for group in groups):
        # holes in the cache layout would count toward a window kept over cache slots
        raise ValueError(f"medusa_generate at batch size > 1 (here {rows}) needs full-attention layers; the model "
                         f"has layer types {[group.layer_type for group in groups]} (use batch size 1)")
    if isinstance(cache, PagedCache) or cache.get_seq_length() > 0:
        raise ValueError(f"medusa_generate at batch size > 1 (here {rows}) needs `past_key_values` to be an empty "
                         f"DynamicCache (the default), got a {type(cache).__name__} holding "
                         f"{cache.get_seq_length()} tokens")


def _prefill(run: _Run) -> torch.Tensor:
    """Run the uncached part of the prompt, decide each row's first token; returns the hidden states `[batch,
    hidden]` that produced them (what the heads read next)."""
    batch, past = run.decoding.batch, run.cache.get_seq_length()
    out = run.model(input_ids=batch.columns[:, past:], attention_mask=None if batch.is_dense else batch.mask,
                    position_ids=batch.positions[:, past:], past_key_values=run.cache, use_cache=True,
                    output_hidden_states=True, logits_to_keep=1)
    prepare_tree_cache(run.cache)  # trims sliding-window layers that recorded the whole prompt
    walk = walk_tree(run.decoding.rules, batch, root_only_tree(), batch.columns[:, -1:], out.logits[:, -1:])
    run.decoding.emit(walk.tokens, walk.num_emitted, walk.fired, walk.num_to_stop)
    return out.hidden_states[-1][:, -1]


def _round(run: _Run, hidden: torch.Tensor) -> torch.Tensor:
    """Verify one tree per row rooted at its last committed token, walk it, keep the accepted paths; returns the
    hidden states `[batch, hidden]` at each row's last kept node."""
    started, batch, trees = time.perf_counter(), run.decoding.batch, run.trees
    index = trees.choose(batch.num_rows)
    tree = trees.trees[index]
    tokens, positions = batch.columns[:, -1:], batch.positions[:, -1:]  # the root, then the candidates
    if tree.num_nodes > 1:  # generate runs under no_grad
        candidates = tree.candidate_tokens(run.heads(hidden.to(run.heads.lm_heads[0].weight.dtype), tree.depth))
        tokens = torch.cat([tokens, candidates.to(tokens.device)], dim=1)  # [batch, num_nodes]
        positions = positions + tree.depths.to(tokens.device)
    out = run.model(input_ids=tokens, attention_mask=_round_mask(run, tree), past_key_values=run.cache,
                    position_ids=positions, use_cache=True, output_hidden_states=True)
    active = batch.unfinished  # new tensors, not views of the batch's state; a plain round accepts no candidates
    remaining = batch.remaining if tree.num_nodes > 1 else None
    walk = walk_tree(run.decoding.rules, batch, tree, tokens, out.logits)
    most = run.decoding.emit(walk.tokens, walk.num_emitted, walk.fired, walk.num_to_stop)
    keep_tree_path(run.cache, tree.num_nodes, walk.nodes[:, : most + 1])
    _record(run, index, walk, active, remaining, time.perf_counter() - started)
    states = out.hidden_states[-1]  # [batch, num_nodes, hidden]
    if tree.num_nodes == 1:  # the root is every row's last node
        return states[:, -1]
    last = walk.nodes.gather(1, (walk.num_emitted - 1).clamp_min(0)[:, None])  # [batch, 1]
    return states.gather(1, last[..., None].expand(-1, -1, hidden.shape[-1]))[:, 0]


def _round_mask(run: _Run, tree: MedusaTree) -> torch.Tensor | dict[str, torch.Tensor] | None:
    batch = run.decoding.batch
    if tree.num_nodes > 1:
        return tree_masks(run.cache, run.groups, tree, batch.mask.bool(), run.model.dtype)
    # the root alone is a plain decoding round: the model builds its own masks (and takes its fast one-query path)
    return None if batch.is_dense else batch.mask


def _record(run: _Run, index: int, walk: Walk, active: torch.Tensor, remaining: torch.Tensor | None,
            seconds: float) -> None:
    """Count the round in the stats; time it for the sizer with what each active row accepted and had `remaining`
    before it (the sizer weighs the furthest-behind rows: the call ends when they do; None for a plain round)."""
    stats, trees = run.decoding.stats, run.trees
    tree = trees.trees[index]
    stats.num_draft_forwards += int(tree.num_nodes > 1)  # the heads ran
    stats.record_round(tree.depth, walk.num_emitted - 1, walk.num_emitted, active, tree.num_nodes - 1)
    if trees.sizer is None:
        return
    num_rows = run.decoding.batch.num_rows
    if remaining is None:  # a plain round accepts no candidates
        trees.sizer.record(index, [], seconds, num_rows)  # the walk synchronised with the device: the time is real
        return
    ranks, rows = trees.ranks[index], active.nonzero().squeeze(1)
    kept = [[ranks[node] for node in nodes[1:count]]
            for nodes, count in zip(walk.nodes[rows].tolist(), walk.num_emitted[rows].tolist())]
    trees.sizer.record(index, kept, seconds, num_rows, remaining[rows].tolist())
