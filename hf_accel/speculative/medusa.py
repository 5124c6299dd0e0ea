"""`medusa_generate`: tree speculative decoding with Medusa heads, as a `custom_generate` callable for `generate`.

    out = model.generate(**inputs, custom_generate=hf_accel.medusa_generate, medusa_heads=heads, max_new_tokens=64)

Each step: the heads read the base model's last hidden state and propose a tree of candidates (top-k per head,
`medusa_tree` paths); ONE forward verifies the root token and all candidates with a 4-D tree mask and depth-based
positions; the walk from the root then decides tokens one at a time exactly as plain decoding would (logits
processors on each position's logits with the tokens decided so far, argmax or one multinomial draw), descending
into the child that holds the decided token, and checks the stopping criteria after every token. So greedy output
equals plain greedy output, sampling draws from exactly the plain distribution (the candidates are deterministic:
following a child whose token was drawn from the model's own distribution is lossless), and nothing overshoots a
stop. The cache then keeps the accepted path only. By default the tree verified is the prefix of the best-first
candidate list with the best measured tokens per second (`tree_size.TreeSizer`; size 0 is a plain step).
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

from ..display import RichDisplay
from .medusa_heads import MedusaHeads
from .tree import DEFAULT_TREE, MedusaTree, build_tree, root_only_tree, tree_position_ids
from .tree_cache import LayerGroup, keep_tree_path, layer_groups, prepare_tree_cache, tree_masks
from .tree_size import TreeSizer, prefix_sizes


@dataclass(slots=True, repr=False)
class MedusaStats(RichDisplay):
    """Counters a caller may pass as `medusa_stats=` to see how speculation went (filled in place)."""

    num_new_tokens: int = 0
    num_verify_forwards: int = 0  # tree forwards after the prefill
    accepted_per_depth: list[int] = field(default_factory=list)  # [depth-1] times a depth-d candidate was accepted
    candidates_per_step: list[int] = field(default_factory=list)  # candidates verified by each tree forward

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target forward (the prefill included, as plain decoding makes one token per forward)."""
        return self.num_new_tokens / max(self.num_verify_forwards + 1, 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Candidates accepted at depth d per tree forward, d = 1.. (head d-1's hit rate on the accepted path)."""
        return [n / self.num_verify_forwards if self.num_verify_forwards else 0.0 for n in self.accepted_per_depth]

    def summary(self) -> dict[str, object]:
        """Tokens, forwards, tokens per step, acceptance per depth (what `repr` and the Jupyter table show)."""
        candidates = self.candidates_per_step
        return {"new_tokens": self.num_new_tokens, "verify_forwards": self.num_verify_forwards,
                "tokens_per_step": self.tokens_per_step, "acceptance_by_depth": self.acceptance_by_depth,
                "mean_candidates": sum(candidates) / len(candidates) if candidates else 0.0}


@dataclass(slots=True)
class _Decoding:
    """One request's state: committed tokens (the last one, the root, not yet in the cache) and what to return."""

    sequence: torch.Tensor  # [1, seq_len]
    valid: torch.Tensor  # [seq_len] bool, False at padding
    scores: list[torch.Tensor]  # [1, vocab] per new token, only when asked for
    raw_logits: list[torch.Tensor]
    finished: bool = False


@dataclass(frozen=True, slots=True)
class _Trees:
    """The trees a call may verify: prefixes of the best-first candidate list (just the whole list when the size is
    fixed), `ranks[i][j]` the best-first rank of node j of `trees[i]` (-1 for the root), and the sizer choosing."""

    trees: tuple[MedusaTree, ...]
    ranks: tuple[tuple[int, ...], ...]
    sizer: TreeSizer | None

    @property
    def whole(self) -> MedusaTree:
        return self.trees[-1]


@dataclass(frozen=True, slots=True)
class _Setup:
    model: PreTrainedModel
    heads: MedusaHeads
    trees: _Trees
    cache: Cache
    groups: list[LayerGroup]
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    do_sample: bool
    keep_scores: tuple[bool, bool]  # (processed scores, raw logits) asked for by output_scores / output_logits
    streamer: BaseStreamer | None
    stats: MedusaStats


def medusa_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    medusa_heads: MedusaHeads | None = None,
    medusa_tree: Sequence[Sequence[int]] | None = None,
    medusa_stats: MedusaStats | None = None,
    medusa_adaptive: bool | None = None,
    hf_accel_streamer: BaseStreamer | None = None,
    **model_kwargs,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Decode with Medusa heads; called by `model.generate(..., custom_generate=medusa_generate, medusa_heads=...)`.

    Args (beyond what generate passes):
        medusa_heads: trained `MedusaHeads` for this model (hidden size and vocab must match).
        medusa_tree: candidate paths, best first (see `hf_accel.speculative.tree`); default: the heads' calibrated
            `config.tree`, else `DEFAULT_TREE` cut to the heads' depth.
        medusa_stats: a `MedusaStats` to fill with tokens per step and acceptance per depth.
        medusa_adaptive: verify each step the prefix of the candidate list with the best measured tokens per
            second (`hf_accel.speculative.tree_size`) rather than the whole tree. Default: True for the default
            tree, False for an explicit `medusa_tree`. Output is the same either way.
        hf_accel_streamer: set by hf_accel's generate hook from `streamer=` (stock generate drops it for callables).
    Batch size 1 only (`input_ids` rows x `num_return_sequences`), no beams. Returns what `_sample` returns.
    """
    setup = _setup(model, input_ids, generation_config, medusa_heads, medusa_stats, hf_accel_streamer,
                   logits_processor, stopping_criteria, model_kwargs,
                   _trees(medusa_heads, medusa_tree, medusa_adaptive))
    input_ids = input_ids.to(model.device)  # generate leaves inputs where the user put them
    state = _Decoding(input_ids, _valid_tokens(input_ids, model_kwargs.get("attention_mask")), [], [])
    try:
        hidden = _prefill(setup, state)
        while not state.finished:
            hidden = _step(setup, state, hidden)
    finally:
        if setup.streamer is not None:
            setup.streamer.end()
    setup.stats.num_new_tokens += state.sequence.shape[1] - input_ids.shape[1]
    return _output(setup, state, generation_config)


def _output(setup: _Setup, state: _Decoding, generation_config: GenerationConfig):
    if not generation_config.return_dict_in_generate:
        return state.sequence
    return GenerateDecoderOnlyOutput(
        sequences=state.sequence,
        scores=tuple(state.scores) if setup.keep_scores[0] else None,
        logits=tuple(state.raw_logits) if setup.keep_scores[1] else None,
        past_key_values=setup.cache if generation_config.use_cache else None,
    )


def _trees(heads: MedusaHeads | None, paths: Sequence[Sequence[int]] | None, adaptive: bool | None) -> _Trees:
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
    return _Trees(trees, ranks, TreeSizer(sizes) if len(sizes) > 1 else None)


def _setup(model, input_ids, generation_config, heads, stats, streamer, processors, criteria, model_kwargs, trees):
    heads.check_compatible(model)
    if generation_config.num_beams > 1:
        raise ValueError(f"medusa_generate does not support beam search: `num_beams` is {generation_config.num_beams}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"medusa_generate decodes one sequence at a time: `input_ids` has batch size "
                         f"{input_ids.shape[0]} (rows x num_return_sequences); batch size > 1 is not supported")
    cache = model_kwargs.get("past_key_values")
    cache = DynamicCache(config=model.config) if cache is None else cache
    prepare_tree_cache(cache)
    stats = stats if stats is not None else MedusaStats()
    stats.accepted_per_depth.extend([0] * (trees.whole.depth - len(stats.accepted_per_depth)))
    if streamer is not None:
        streamer.put(input_ids.cpu())
    return _Setup(model, heads, trees, cache, layer_groups(model.config), processors, criteria,
                  bool(generation_config.do_sample),
                  (bool(generation_config.output_scores), bool(generation_config.output_logits)), streamer, stats)


def _valid_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(input_ids.shape[1], dtype=torch.bool, device=input_ids.device)
    return attention_mask[0].bool().to(input_ids.device)


def _positions(valid: torch.Tensor) -> torch.Tensor:
    # as generate computes them: index among non-padding tokens (padding gets 1, never attended)
    return (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)


def _prefill(setup: _Setup, state: _Decoding) -> torch.Tensor:
    """Run the uncached part of the prompt, decide the first token; returns the hidden state `[hidden]` that
    produced it (what the heads read next)."""
    past = setup.cache.get_seq_length()
    fresh = state.sequence[:, past:]
    mask = None if bool(state.valid.all()) else state.valid.long()[None]
    out = setup.model(input_ids=fresh, attention_mask=mask, position_ids=_positions(state.valid)[None, past:],
                      past_key_values=setup.cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    prepare_tree_cache(setup.cache)  # trims sliding-window layers that recorded the whole prompt
    _decide(setup, state, out.logits[0, -1])
    return out.hidden_states[-1][0, -1]


def _step(setup: _Setup, state: _Decoding, hidden: torch.Tensor) -> torch.Tensor:
    """Verify one tree rooted at the last committed token, decide tokens along it; returns the new hidden state."""
    started, cache, trees = time.perf_counter(), setup.cache, setup.trees
    index = trees.sizer.choose() if trees.sizer is not None else len(trees.trees) - 1
    tree = trees.trees[index]
    tokens = state.sequence[0, -1:]  # [num_nodes]: the root, then the candidates
    if tree.num_nodes > 1:  # generate runs under no_grad
        candidates = tree.candidate_tokens(setup.heads(hidden.to(_heads_dtype(setup.heads))))
        tokens = torch.cat([tokens, candidates.to(tokens.device)])
    root_position = int(_positions(state.valid)[-1])
    out = setup.model(
        input_ids=tokens[None], attention_mask=_step_mask(setup, state, tree),
        position_ids=tree_position_ids(tree, root_position).to(tokens.device), past_key_values=cache, use_cache=True,
        output_hidden_states=True,
    )
    kept = _walk(setup, state, tree, tokens.tolist(), out.logits[0])
    keep_tree_path(cache, tree.num_nodes, kept)
    setup.stats.num_verify_forwards += 1
    setup.stats.candidates_per_step.append(tree.num_nodes - 1)
    if trees.sizer is not None:  # the walk synchronised with the device (tolist), so the time is real
        trees.sizer.record(index, [trees.ranks[index][node] for node in kept[1:]], time.perf_counter() - started)
    return out.hidden_states[-1][0, kept[-1]]


def _step_mask(setup: _Setup, state: _Decoding, tree: MedusaTree) -> torch.Tensor | dict[str, torch.Tensor] | None:
    if tree.num_nodes > 1:
        return tree_masks(setup.cache, setup.groups, tree, state.valid, setup.model.dtype)
    # the root alone is a plain decoding step: the model builds its own masks (and takes its fast one-query path)
    return None if bool(state.valid.all()) else state.valid.long()[None]


def _walk(setup: _Setup, state: _Decoding, tree: MedusaTree, tokens: list[int], logits: torch.Tensor) -> list[int]:
    """Decide tokens from the root down while the decided token is a child's; returns the kept nodes (root first),
    i.e. every node whose token is now committed except the last committed token."""
    kept = [0]
    while True:
        token = _decide(setup, state, logits[kept[-1]])
        if state.finished:
            return kept
        child = next((c for c in tree.children[kept[-1]] if tokens[c] == token), None)
        if child is None:
            return kept
        kept.append(child)
        setup.stats.accepted_per_depth[len(kept) - 2] += 1


def _decide(setup: _Setup, state: _Decoding, raw_logits: torch.Tensor) -> int:
    """Commit one token from `raw_logits` `[vocab]` exactly as `_sample` would: processors, then argmax or one
    multinomial draw; streams it and checks the stopping criteria after it."""
    raw = raw_logits[None].to(copy=True, dtype=torch.float32)  # [1, vocab]
    scores = raw
    for processor in setup.logits_processor:  # LogitsProcessorList.__call__ minus its per-call signature inspection
        scores = processor(state.sequence, scores)
    if setup.do_sample:
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        token = torch.argmax(scores, dim=-1)
    state.sequence = torch.cat([state.sequence, token[:, None]], dim=-1)
    state.valid = torch.cat([state.valid, state.valid.new_ones(1)])
    if setup.keep_scores[0]:
        state.scores.append(scores)
    if setup.keep_scores[1]:
        state.raw_logits.append(raw)
    if setup.streamer is not None:
        setup.streamer.put(token.cpu())
    state.finished = bool(setup.stopping_criteria(state.sequence, scores).any())
    return int(token)


def _heads_dtype(heads: MedusaHeads) -> torch.dtype:
    return heads.lm_heads[0].weight.dtype
