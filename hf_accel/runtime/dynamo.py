"""hf_accel's dynamo settings around its compiled graphs, and the guard stance of warm steps.

Every compiled caller (the engine's step, compiled generate's loops, an EAGLE head's passes) traces under
`dynamo_settings()`: recompile limits raised so a long notebook or test session keeps compiling, and Python floats
traced as constants where that is safe. Steps of an engine-core process may skip dynamo's full guards once every
graph is warm (`skip_warm_guards`, `warm_guards`). An engine's step graphs are compiled without guards on module hooks
(`without_hook_guards`), keyed instead by the hooks the model has when they compile (`hooks_key`).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

RECOMPILE_LIMIT = 256  # graphs of one model class in one process (two per compiled engine)
# graphs of every function in one process: dynamo's default (256) is reached by a long notebook or test session, after
# which it compiles nothing more (an engine would run eagerly, compiled generate would raise)
ACCUMULATED_RECOMPILE_LIMIT = 8192


_SKIP_WARM_GUARDS = False


def skip_warm_guards(enabled: bool) -> None:
    """Let warm engine steps skip dynamo's guards in this process: for a process where only the engine's thread runs
    compiled code (the engine-core process)."""
    global _SKIP_WARM_GUARDS
    _SKIP_WARM_GUARDS = enabled


_BACKGROUND_COMPILES = 0  # compiles running in background threads (`step_forward.StepForward.warm_up`)
_BACKGROUND_LOCK = threading.Lock()


def begin_background_compile() -> None:
    """A thread starts compiling: until it ends, no call skips guards (dynamo's stance is process-wide, and the
    compiling thread's first calls must run every guard)."""
    global _BACKGROUND_COMPILES
    with _BACKGROUND_LOCK:
        _BACKGROUND_COMPILES += 1


def end_background_compile() -> None:
    global _BACKGROUND_COMPILES
    with _BACKGROUND_LOCK:
        _BACKGROUND_COMPILES -= 1


def warm_guards(warm: bool):
    """Dynamo's stance for one call of graphs traced at start: the distinguishing guards only, when `warm` (every
    graph compiled) in a process that allows it (`skip_warm_guards`) and no background compile runs; otherwise the
    stance is left as it is."""
    if warm and _SKIP_WARM_GUARDS and not _BACKGROUND_COMPILES:
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def dynamo_settings(constant_floats: bool = True):
    """hf_accel's dynamo config patch around its compiled graphs: both recompile limits raised to hf_accel's (never
    lowered), and with `constant_floats` every Python float traced as the constant it is. Rule: a module's float
    attribute (an attention's `scaling`, which reaches the paged-attention op) is otherwise traced as a symbol, the op
    specializes it, and dynamo's tensorify pass then restarts the analysis: the whole graph traced and handed to AOT
    twice, a third of each compile. A call that samples inside its graph passes False, so that its warpers'
    temperature / top-p stay graph inputs and another value reuses the graph."""
    config = torch._dynamo.config
    return config.patch(recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT),
                        accumulated_recompile_limit=max(config.accumulated_recompile_limit,
                                                        ACCUMULATED_RECOMPILE_LIMIT),
                        specialize_float=constant_floats or config.specialize_float)


# a guard whose source goes through a module's (or torch's global) hook dicts: `_forward_hooks`, `_forward_pre_hooks`,
# `_backward_hooks`, ... with their `_with_kwargs` / `_always_called` companions, and what their hooks close over
_HOOK_SOURCE = re.compile(r"\b_(?:global_)?(?:forward|forward_pre|backward|backward_pre)_hooks"
                          r"(?:_with_kwargs|_always_called)?\b")


def without_hook_guards(entries: Sequence[Any]) -> list[bool]:
    """`torch.compile`'s `guard_filter_fn` for an engine's step graphs: every guard but those on module hooks. Rule:
    those are more than half of a step's guards (each module's empty hook dicts, each LoRA hook's closure: 5,000 of
    8,700 entries on the reference target with adapters) and checking them is 0.5 ms of a 4 ms step; the hooks a step
    runs are fixed when it compiles instead, its graphs kept under `hooks_key` (a hook added to the model afterwards
    is not run by the compiled step, as its weights changed afterwards are not: both are frozen in)."""
    return [_HOOK_SOURCE.search(entry.name) is None for entry in entries]


def hooks_key(model: nn.Module) -> tuple:
    """The forward hooks `model`'s modules and torch's global hook dicts hold now (their handles' ids), to key graphs
    compiled `without_hook_guards` by: a model whose hooks changed gets graphs of its own."""
    from torch.nn.modules import module as module_globals

    local = tuple((name, tuple(m._forward_pre_hooks), tuple(m._forward_hooks)) for name, m in model.named_modules()
                  if m._forward_pre_hooks or m._forward_hooks)
    return local, tuple(module_globals._global_forward_pre_hooks), tuple(module_globals._global_forward_hooks)
