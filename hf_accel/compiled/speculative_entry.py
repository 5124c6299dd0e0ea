"""`ngram_generate`, `draft_generate`, `eagle_generate` and `medusa_generate` under `compile_config`: the callables
`route.py` puts in their place.

Each entry has its eager function's signature (`functools.wraps`, so generate hands it the same keyword arguments)
and checks the eager function's own arguments with the same record (`NgramOptions`, `DraftOptions`, `EagleOptions`,
`MedusaOptions`: the same errors). It runs the compiled loop (`ngram_loop.py`, `draft_loop.py`, `eagle_loop.py` or
`eagle_tree_loop.py`, `medusa_loop.py`) when its drafter's `uncovered` rule (`target_rounds.speculation_uncovered`,
plus a tree rule for trees) finds nothing against the call; otherwise it warns, naming the reason, and calls the
eager function with what it was given.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from ..speculative.decoding import GenerateCall
from ..speculative.draft import DraftOptions, draft_generate
from ..speculative.eagle import EagleOptions, eagle_generate
from ..speculative.medusa import MedusaOptions, medusa_generate
from ..speculative.ngram import NgramOptions, ngram_generate
from ..speculative.tree_cache import layer_groups
from .draft_loop import compiled_draft_generate
from .eagle_loop import compiled_eagle_generate
from .eagle_tree_loop import compiled_eagle_tree_generate
from .medusa_loop import compiled_medusa_generate
from .ngram_loop import compiled_ngram_generate
from .target_rounds import speculation_uncovered

_POSITIONAL = ("model", "input_ids", "logits_processor", "stopping_criteria", "generation_config")


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledLoop:
    """How one eager speculative function runs compiled: its options record, why a call is not covered (None: it
    is), and the compiled loop, both given the call and its checked options."""

    eager: Callable
    options: type
    uncovered: Callable[[GenerateCall, Any], str | None]
    run: Callable[[GenerateCall, Any], Any]


def compiled_entry(loop: CompiledLoop) -> Callable:
    """The callable that stands in for `loop.eager` under `compile_config` (see the module docstring)."""

    @functools.wraps(loop.eager)
    def entry(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        call, options = _call(loop, (model, input_ids, logits_processor, stopping_criteria, generation_config), kwargs)
        reason = loop.uncovered(call, options)
        if reason is None:
            return loop.run(call, options)
        warnings.warn(f"hf_accel: compile_config is not applied to {loop.eager.__name__} ({reason}); it decodes "
                      "eagerly", UserWarning, stacklevel=3)
        return loop.eager(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)

    return entry


def _call(loop: CompiledLoop, args: tuple, kwargs: dict[str, Any]) -> tuple[GenerateCall, Any]:
    """The call as the eager function sees it (its own keyword options, given or default, apart from the model
    inputs), and its options record."""
    defaults = {name: param.default for name, param in inspect.signature(loop.eager).parameters.items()
                if name not in _POSITIONAL and param.kind is param.POSITIONAL_OR_KEYWORD}
    named = {name: kwargs.get(name, default) for name, default in defaults.items()}
    options = loop.options(**{f.name: named[f.name] for f in dataclasses.fields(loop.options) if f.init})
    model_kwargs = {key: value for key, value in kwargs.items() if key not in defaults}
    return GenerateCall(*args, named["hf_accel_streamer"], model_kwargs), options


def _tree_uncovered(model: PreTrainedModel, num_nodes: int) -> str | None:
    """Why a compiled tree verify of up to `num_nodes` nodes cannot run on `model` (the paged tree attention measures
    windows from a node's depth, inside windows longer than the tree), or None."""
    windows = [g.sliding_window for g in layer_groups(model.config) if g.sliding_window is not None]
    if any(window <= num_nodes for window in windows):
        return f"sliding windows {windows} no longer than the tree ({num_nodes} nodes)"
    return None


def _ngram_uncovered(call: GenerateCall, options: NgramOptions) -> str | None:
    return speculation_uncovered([call.model], call, sampling=True)


def _draft_uncovered(call: GenerateCall, options: DraftOptions) -> str | None:
    return speculation_uncovered([call.model, options.draft_model], call, sampling=True)


def _eagle_uncovered(call: GenerateCall, options: EagleOptions) -> str | None:
    tree = options.eagle_tree  # sampled trees: the eager loop's lossless walk
    reason = speculation_uncovered([call.model], call, sampling=tree is None)
    return reason if reason is not None or tree is None else _tree_uncovered(call.model, tree.total_tokens + 1)


def _medusa_uncovered(call: GenerateCall, options: MedusaOptions) -> str | None:
    reason = speculation_uncovered([call.model], call)  # sampled trees: the eager loop's lossless walk
    return reason if reason is not None else _tree_uncovered(call.model, options.trees.whole.num_nodes)


def _compiled_eagle(call: GenerateCall, options: EagleOptions) -> Any:
    run = compiled_eagle_generate if options.eagle_tree is None else compiled_eagle_tree_generate
    return run(call, options)


LOOPS = (CompiledLoop(ngram_generate, NgramOptions, _ngram_uncovered, compiled_ngram_generate),
         CompiledLoop(draft_generate, DraftOptions, _draft_uncovered, compiled_draft_generate),
         CompiledLoop(eagle_generate, EagleOptions, _eagle_uncovered, _compiled_eagle),
         CompiledLoop(medusa_generate, MedusaOptions, _medusa_uncovered, compiled_medusa_generate))
COMPILED_ENTRIES = {loop.eager: compiled_entry(loop) for loop in LOOPS}
