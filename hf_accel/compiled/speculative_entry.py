"""`ngram_generate`, `draft_generate`, `eagle_generate` and `medusa_generate` under `compile_config`: the callables
`route.py` puts in their place.

Each entry has its eager function's signature (`functools.wraps`, so generate hands it the same keyword arguments)
and runs the compiled loop (`ngram_loop.py`, `draft_loop.py`, `eagle_loop.py`, `medusa_loop.py`) when
`speculation.speculation_uncovered` finds nothing against it; otherwise it warns, naming the reason, and calls the
eager function with what it was given.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from ..speculative.chain_checks import check_draft_vocabulary
from ..speculative.draft import draft_generate
from ..speculative.draft_budget import DraftBudget
from ..speculative.draft_length import DraftLength
from ..speculative.ngram import check_ngram_options, ngram_generate
from ..speculative.ngram_proposer import NgramSettings
from ..speculative.stats import SpeculativeStats
from ..speculative.eagle import check_probability, eagle_generate
from ..speculative.eagle_head import EagleHead
from ..speculative.eagle_tree import EagleTree
from ..speculative.medusa import medusa_generate, trees_for
from ..speculative.medusa_heads import MedusaHeads
from ..speculative.tree_cache import layer_groups
from .draft_loop import compiled_draft_generate
from .eagle_loop import compiled_eagle_generate
from .eagle_tree_loop import compiled_eagle_tree_generate
from .medusa_loop import compiled_medusa_generate
from .ngram_loop import compiled_ngram_generate
from .speculation import speculation_uncovered

_POSITIONAL = ("model", "input_ids", "logits_processor", "stopping_criteria", "generation_config")


def _options(eager: Callable, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`eager`'s own keyword options (given, else their defaults) and the rest of `kwargs` (the model inputs)."""
    names = {name: param.default for name, param in inspect.signature(eager).parameters.items()
             if name not in _POSITIONAL and param.kind is param.POSITIONAL_OR_KEYWORD}
    options = {name: kwargs.get(name, default) for name, default in names.items()}
    return options, {key: value for key, value in kwargs.items() if key not in names}


def _eagerly(eager: Callable, reason: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    warnings.warn(f"hf_accel: compile_config is not applied to {eager.__name__} ({reason}); it decodes eagerly",
                  UserWarning, stacklevel=4)
    return eager(*args, **kwargs)


@functools.wraps(ngram_generate)
def compiled_ngram_entry(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    args = (model, input_ids, logits_processor, stopping_criteria, generation_config)
    options, model_kwargs = _options(ngram_generate, kwargs)
    reason = speculation_uncovered([model], generation_config, logits_processor, stopping_criteria, model_kwargs,
                                   sampling=True)
    if reason is not None:
        return _eagerly(ngram_generate, reason, args, kwargs)
    check_ngram_options(options["suffix_cache"], options["ngram_settings"], options["max_draft_tokens"],
                        options["draft_token_cost"], options["ngram_stats"])
    stats = options["ngram_stats"] if options["ngram_stats"] is not None else SpeculativeStats()
    return compiled_ngram_generate(
        model, input_ids, model_kwargs.get("attention_mask"), generation_config,
        options["ngram_settings"] or NgramSettings(), options["suffix_cache"],
        DraftBudget(options["max_draft_tokens"], options["draft_token_cost"]), stats, options["hf_accel_streamer"],
        tuple(logits_processor) if generation_config.do_sample else ())


@functools.wraps(draft_generate)
def compiled_draft_entry(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    args = (model, input_ids, logits_processor, stopping_criteria, generation_config)
    options, model_kwargs = _options(draft_generate, kwargs)
    draft = options["draft_model"]
    if draft is None:  # the eager function raises the error that names the argument
        return draft_generate(*args, **kwargs)
    reason = speculation_uncovered([model, draft], generation_config, logits_processor, stopping_criteria,
                                   model_kwargs, sampling=True)
    if reason is not None:
        return _eagerly(draft_generate, reason, args, kwargs)
    check_draft_vocabulary(model, draft)
    stats = options["draft_stats"] if options["draft_stats"] is not None else SpeculativeStats()
    return compiled_draft_generate(
        model, draft, input_ids, model_kwargs.get("attention_mask"), generation_config,
        DraftLength(options["num_draft_tokens"], options["max_draft_tokens"]), stats, options["hf_accel_streamer"],
        tuple(logits_processor) if generation_config.do_sample else ())


@functools.wraps(eagle_generate)
def compiled_eagle_entry(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    args = (model, input_ids, logits_processor, stopping_criteria, generation_config)
    options, model_kwargs = _options(eagle_generate, kwargs)
    head = options["eagle_head"]
    if not isinstance(head, EagleHead):  # the eager function raises the error that names the argument
        return eagle_generate(*args, **kwargs)
    tree = options["eagle_tree"]
    if tree is not None and not isinstance(tree, EagleTree):  # the eager function raises the error naming it
        return eagle_generate(*args, **kwargs)
    reason = speculation_uncovered([model], generation_config, logits_processor, stopping_criteria, model_kwargs,
                                   sampling=tree is None)  # sampled trees: the eager loop's lossless walk
    if reason is None and tree is not None:
        reason = _tree_uncovered(model, tree.total_tokens + 1)
    if reason is not None:
        return _eagerly(eagle_generate, reason, args, kwargs)
    head.check_compatible(model)
    min_probability = check_probability(options["min_draft_probability"])
    stats = options["eagle_stats"] if options["eagle_stats"] is not None else SpeculativeStats()
    if tree is not None:
        return compiled_eagle_tree_generate(model, head, tree, input_ids, model_kwargs.get("attention_mask"),
                                            generation_config, stats, options["hf_accel_streamer"])
    return compiled_eagle_generate(
        model, head, input_ids, model_kwargs.get("attention_mask"), generation_config,
        DraftLength(options["num_draft_tokens"], options["max_draft_tokens"]), min_probability, stats,
        options["hf_accel_streamer"], tuple(logits_processor) if generation_config.do_sample else ())


@functools.wraps(medusa_generate)
def compiled_medusa_entry(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    args = (model, input_ids, logits_processor, stopping_criteria, generation_config)
    options, model_kwargs = _options(medusa_generate, kwargs)
    heads = options["medusa_heads"]
    if not isinstance(heads, MedusaHeads):  # the eager function raises the error that names the argument
        return medusa_generate(*args, **kwargs)
    trees = trees_for(heads, options["medusa_tree"], options["medusa_adaptive"])
    reason = speculation_uncovered([model], generation_config, logits_processor, stopping_criteria, model_kwargs)
    if reason is None:
        reason = _tree_uncovered(model, trees.whole.num_nodes)
    if reason is not None:
        return _eagerly(medusa_generate, reason, args, kwargs)
    heads.check_compatible(model)
    stats = options["medusa_stats"] if options["medusa_stats"] is not None else SpeculativeStats()
    return compiled_medusa_generate(model, heads, trees, input_ids, model_kwargs.get("attention_mask"),
                                    generation_config, stats, options["hf_accel_streamer"])


def _tree_uncovered(model, num_nodes: int) -> str | None:
    """Why a compiled tree verify of up to `num_nodes` nodes cannot run on `model` (the paged tree attention measures
    windows from a node's depth, inside windows longer than the tree), or None."""
    windows = [g.sliding_window for g in layer_groups(model.config) if g.sliding_window is not None]
    if any(window <= num_nodes for window in windows):
        return f"sliding windows {windows} no longer than the tree ({num_nodes} nodes)"
    return None


COMPILED_ENTRIES = {ngram_generate: compiled_ngram_entry, draft_generate: compiled_draft_entry,
                    eagle_generate: compiled_eagle_entry, medusa_generate: compiled_medusa_entry}
