"""`eagle_generate`: speculative decoding with an EAGLE-3-style head, as a `custom_generate` callable for `generate`.

    head = hf_accel.EagleHead.from_pretrained("./my-head", model)
    out = model.generate(**inputs, custom_generate=hf_accel.eagle_generate, eagle_head=head, max_new_tokens=64)

Each round the head drafts a chain of up to k tokens autoregressively on its own features and its own small KV cache
(`eagle_draft.HeadState`): the first draft step reads the target's fused features of the tokens committed last
round, every later one the head's own output. The target then scores the k + 1 positions in one forward (with its
hidden states, the next round's features), and the chain rounds `draft_generate` uses (`chain.py`) keep each row's
accepted prefix: `verify.greedy_accept`, or lossless `verify.speculative_sample` against the head's processed
distributions. Rows accept different numbers of tokens through holes (`RaggedBatch`); k adapts (`DraftLength`), and
a chain ends early after a draft the head itself gave less than `min_draft_probability` (EAGLE-2's observation: the
head's confidence predicts acceptance). With `eagle_tree=hf_accel.EagleTree(...)` each round instead grows an EAGLE-2
dynamic tree per row (`eagle_tree.py`) and verifies it with the Medusa tree machinery (tree masks, the walk, keeping
the accepted path). With `compile_config` in the generation config, greedy calls and calls
sampling with temperature / top-k / top-p / min-p only run compiled instead (`hf_accel/compiled/eagle_loop.py`, on
CPU too; their output's `past_key_values` is None); greedy trees too (`hf_accel/compiled/eagle_tree_loop.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.paged import PagedCache
from ..runtime.host_argmax import argmax_rows
from . import chain
from .chain_checks import check_call
from .decoding import Decoding, GenerateCall
from .draft import RoundCandidates
from .draft_length import DraftLength
from .eagle_draft import HeadState, new_head_state
from .eagle_head import EagleHead
from .eagle_tree import EagleTree, eager_expand, grow_tree, top_children
from .medusa_walk import walk_tree
from .stats import SpeculativeStats
from .tree_cache import LayerGroup, keep_tree_path, layer_groups, prepare_tree_cache, tree_masks

__all__ = ["eagle_generate"]


@dataclass(slots=True)
class EagleOptions:
    """`eagle_generate`'s own arguments (see its docstring), checked (`TypeError` / `ValueError` naming the wrong
    one), with the call's `DraftLength`."""

    eagle_head: EagleHead
    num_draft_tokens: int
    max_draft_tokens: int
    min_draft_probability: float
    eagle_tree: EagleTree | None
    eagle_stats: SpeculativeStats | None
    length: DraftLength = field(init=False)

    def __post_init__(self) -> None:
        value = self.min_draft_probability
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"`min_draft_probability` must be a number in [0, 1), got {value!r}")
        self.min_draft_probability = float(value)
        self.length = DraftLength(self.num_draft_tokens, self.max_draft_tokens)
        if not isinstance(self.eagle_head, EagleHead):
            raise TypeError(f"eagle_generate needs `eagle_head=` (a hf_accel.EagleHead trained for this model), got "
                            f"{type(self.eagle_head).__name__}")
        if self.eagle_tree is not None and not isinstance(self.eagle_tree, EagleTree):
            raise TypeError(f"`eagle_tree` must be a hf_accel.EagleTree or None, got {type(self.eagle_tree).__name__}")


@dataclass(slots=True)
class _Run:
    """One `eagle_generate` call: the loop's state, the target and its cache, the head's state, the options."""

    decoding: Decoding
    model: PreTrainedModel
    cache: Cache
    head: HeadState
    options: EagleOptions
    groups: list[LayerGroup]  # the target's layer types, for tree masks


def eagle_generate(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                   stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                   eagle_head: EagleHead | None = None, num_draft_tokens: int = 4, max_draft_tokens: int = 8,
                   min_draft_probability: float = 0.2, eagle_tree: EagleTree | None = None,
                   eagle_stats: SpeculativeStats | None = None, tokenizer: Any = None, hf_accel_streamer: Any = None,
                   **model_kwargs: Any) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Decode with an EAGLE head; called by `model.generate(..., custom_generate=eagle_generate, eagle_head=...)`.

    Greedy output equals plain greedy `generate`; sampling is lossless. Any batch size (left padding, rows accepting
    different numbers of tokens; batch size > 1 needs full-attention layers), with the cache `generate` built for
    the target (DynamicCache, `cache_implementation="paged"`, any croppable cache).

    Args (beyond what generate passes):
        eagle_head: an `EagleHead` trained for this model.
        num_draft_tokens: chain length k of the first round; later rounds adapt (`DraftLength`).
        max_draft_tokens: the longest chain a round may draft.
        min_draft_probability: a chain ends early after a candidate to which the head gave less than this
            probability in every generating row (0 drafts the whole k), in [0, 1).
        eagle_tree: an `EagleTree` to draft EAGLE-2 dynamic trees instead of chains (the three options above then
            do not apply). Needs a DynamicCache or, at batch size 1, the paged cache; under `compile_config` greedy
            trees run compiled at any batch size, sampled ones eagerly.
        eagle_stats: a `SpeculativeStats` to add this call's counters to (`num_draft_forwards`: head passes).
        tokenizer: needed by `stop_strings` (generate hands it only to callables that name it).
        hf_accel_streamer: the `streamer=` of `generate` (hf_accel's registry forwards it under this name).
    Returns what `generate` returns: `sequences` `[batch, prompt + new]` (finished rows padded with
    `pad_token_id`), or a `GenerateDecoderOnlyOutput` with `scores` / `logits` / `past_key_values` when asked (at
    batch size > 1 the cache holds holes, see `RaggedBatch`: not to be continued from).
    """
    options = EagleOptions(eagle_head, num_draft_tokens, max_draft_tokens, min_draft_probability, eagle_tree,
                           eagle_stats)
    call = GenerateCall(model, input_ids, logits_processor, stopping_criteria, generation_config, hf_accel_streamer,
                        model_kwargs)
    run = _start(call, options)
    one_round = _round if eagle_tree is None else _tree_round
    run.decoding.run(lambda: _prefill(run), lambda _: one_round(run), (model, eagle_head))
    return run.decoding.output(generation_config, run.cache)


def _start(call: GenerateCall, options: EagleOptions) -> _Run:
    check_call(call, "eagle_generate")
    head = options.eagle_head
    head.check_compatible(call.model)
    cache = call.model_kwargs["past_key_values"]
    groups = [] if options.eagle_tree is None else _tree_groups(call, cache)
    decoding = Decoding.start(call, options.eagle_stats)
    cache.activate_past_recording()  # sliding-window layers must keep what a crop may take back
    state = new_head_state(head, call.input_ids.shape[0], call.input_ids.device)
    return _Run(decoding, call.model, cache, state, options, groups)


def _tree_groups(call: GenerateCall, cache: Cache) -> list[LayerGroup]:
    """The target's layer groups for tree masks; `ValueError` for a cache trees cannot prune (per-row paths need a
    DynamicCache at batch size > 1)."""
    prepare_tree_cache(cache)
    if call.input_ids.shape[0] > 1 and isinstance(cache, PagedCache):
        raise ValueError(f"`eagle_tree` at batch size > 1 (here {call.input_ids.shape[0]}) needs a DynamicCache "
                         "(`past_key_values`): each row keeps its own path")
    return layer_groups(call.model.config)


def _target_forward(run: _Run, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw fp32 logits `[batch, keep, vocab]` of the last `keep` of `ids` appended to the target's cache, and the
    head's fused features of every one of `ids`, `[batch, n, H]`."""
    batch = run.decoding.batch
    out = run.model(input_ids=ids, attention_mask=None if batch.is_dense else mask, position_ids=positions,
                    past_key_values=run.cache, use_cache=True, output_hidden_states=True, logits_to_keep=keep)
    return out.logits[:, -keep:].to(dtype=torch.float32, copy=True), run.head.head.fuse(out.hidden_states)


def _prefill(run: _Run) -> None:
    """Target forward over the prompt; its first token exactly as plain `generate` picks it; the prompt's fused
    features wait for the head."""
    batch = run.decoding.batch
    logits, features = _target_forward(run, batch.columns, batch.mask, batch.positions, 1)
    run.head.add_pending(features)
    if run.options.eagle_tree is not None:
        prepare_tree_cache(run.cache)  # trims sliding-window layers that recorded the whole prompt
    chain.first_token(run.decoding, run.cache, logits[:, 0])


def _round(run: _Run) -> None:
    """Draft k candidates per row with the head, verify them in one target forward, keep each row's accepted
    prefix."""
    started, batch = time.perf_counter(), run.decoding.batch
    rows, remaining = batch.columns.shape[0], batch.remaining[batch.unfinished].tolist()
    k = run.options.length.next(max(remaining), rows)
    drafted = _draft(run, k)
    k = drafted.tokens.shape[1]  # the chain may end early
    ids, mask, positions = chain.verify_inputs(batch, drafted.tokens)
    logits, features = _target_forward(run, ids, mask, positions, k + 1)
    verdict, scores, logits = chain.decide(run.decoding, logits, drafted.tokens, drafted.history, drafted.probs)
    accepted = verdict.num_accepted[batch.unfinished].tolist()
    most = chain.keep(run.decoding, run.cache, verdict, scores, logits, k=k, record=True)
    run.head.add_pending(features[:, : most + 1])  # slot i: the root (i = 0), then accepted draft i
    run.options.length.update(k, accepted, rows, time.perf_counter() - started, remaining)


def _draft(run: _Run, k: int) -> RoundCandidates:
    """Up to `k` candidates per row: the head catches up on the last round's features, then drafts on its own."""
    batch, rules, state = run.decoding.batch, run.decoding.rules, run.head
    candidates = batch.columns.new_full((batch.columns.shape[0], k), batch.pad_token_id)
    history, probs = batch.with_candidates(candidates), []
    if k == 0:
        return RoundCandidates(candidates, None, history)
    hidden = state.catch_up(run.model, batch)
    for j in range(k):
        lengths = batch.history_lengths + j
        scores = rules.process(batch.view(history, lengths), state.head.logits(run.model, hidden), lengths)
        probs.append(torch.softmax(scores, dim=-1))
        token = torch.multinomial(probs[-1], 1).squeeze(1) if rules.do_sample else argmax_rows(scores)
        candidates[:, j] = token
        history.scatter_(1, (batch.history_lengths + j)[:, None], token[:, None])
        confident = probs[-1].gather(1, token[:, None])[:, 0] >= run.options.min_draft_probability
        if j + 1 == k or not bool((confident & batch.unfinished).any()):
            break
        hidden = state.draft_step(run.model, batch, hidden, token, j)
    state.drop_drafts()
    run.decoding.stats.num_draft_forwards += len(probs)
    sampled = torch.stack(probs, dim=1) if rules.do_sample else None
    return RoundCandidates(candidates[:, : len(probs)], sampled, history)


def _tree_round(run: _Run) -> None:
    """Grow each row's EAGLE-2 tree, verify every tree in one target forward, walk it, keep the accepted paths."""
    batch, state = run.decoding.batch, run.head
    settings = run.options.eagle_tree
    hidden, k = state.catch_up(run.model, batch), settings.top_k
    tree, passes = grow_tree(eager_expand(state, run.model, batch, k), hidden, batch.columns[:, -1],
                             top_children(run.model, state.head, hidden, k), settings)
    state.drop_drafts()
    out = run.model(input_ids=tree.tokens, position_ids=batch.positions[:, -1:] + tree.depths,
                    attention_mask=tree_masks(run.cache, run.groups, tree, batch.mask.bool(), run.model.dtype),
                    past_key_values=run.cache, use_cache=True, output_hidden_states=True)
    active = batch.unfinished  # a new tensor, not a view of the batch's state
    walk = walk_tree(run.decoding.rules, batch, tree, tree.tokens, out.logits)
    most = run.decoding.emit(walk.tokens, walk.num_emitted, walk.fired, walk.num_to_stop)
    kept = walk.nodes[:, : most + 1]  # slot i: the root (i = 0), then the node accepted at depth i
    keep_tree_path(run.cache, tree.num_nodes, kept)
    features = state.head.fuse(out.hidden_states)  # [batch, num_nodes, H]
    state.add_pending(features.gather(1, kept[..., None].expand(-1, -1, features.shape[-1])))
    run.decoding.stats.num_draft_forwards += 1 + passes  # the catch-up, then one pass per grown level
    run.decoding.stats.record_round(tree.depth, walk.num_emitted - 1, walk.num_emitted, active, tree.num_nodes - 1)
