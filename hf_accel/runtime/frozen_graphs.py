"""Compiled functions whose graphs hold a model's weights frozen (inductor's `freezing`), kept per model; and the
engine's Linear panels (`panels_for`), kept the same way.

On CPU hf_accel compiles its steps with `freezing`: each Linear's weight becomes a constant of the graph, packed once,
into column panels for hf_accel's kernel in fp32 (`kernels/packed_linear.py`), else for oneDNN's matmul (both faster
than MKL's sgemm over the weights as they lie at a few rows: benchmarks/bench_linear.py). A frozen graph must then serve
only the model it froze, and only while that model's weights are the ones it holds. Dynamo keeps graphs on the code
object it traced, and its guards tell models apart but not weight values, so each model compiles its own copy of a step
function (`own_code`), kept here beside a `weights_signature`; a model whose weights changed (an optimizer step,
`load_state_dict`, a merged adapter, a cast) gets new copies, and the old graphs go with them. Engines on the same
unchanged model share their graphs. Across processes, fp32 graphs are kept in inductor's FX graph cache under a
fingerprint of the weights they freeze (the owner's and its companions', set around each call of a compiled
function: `kernels.packed_linear.PackLinears.uuid`), so a restart on the same weights loads them.
An engine's fp32 steps freeze nothing: their Linears run over panels packed once per model and weights (`panels_for`,
`kernels/linear_panels.py`), graph inputs like the weights, so those steps are saved whole and serve any weights of
the same shapes (`saved_steps.py`). Panels and graphs are kept here all the same: the graphs read the panels'
forwards, which every engine on the model must share.
"""

from __future__ import annotations

import functools
import hashlib
import types
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
import torch._inductor.config as inductor_config
from torch import nn

from ..kernels.linear_panels import LinearPanels
from ..kernels.packed_linear import FROZEN_WEIGHTS, settings as packed_linear_settings
from ..quant.sibling_linears import MergeSiblingLinears


@dataclass
class _ModelGraphs:
    weights: tuple
    modules: tuple[weakref.ref, ...]  # the model, then the other modules whose weights the graphs hold
    functions: dict[Hashable, Callable] = field(default_factory=dict)
    digest: str | None = None  # `weights_fingerprint` of `modules` once asked for ("": not cached)
    panels: LinearPanels | None | bool = False  # `panels_for`'s, once asked for (False: not yet)

    def holds(self, weights: tuple, companions: tuple[nn.Module, ...]) -> bool:
        return (self.weights == weights and len(self.modules) == len(companions) + 1
                and all(ref() is module for ref, module in zip(self.modules[1:], companions)))

    def fingerprint(self) -> str | None:
        """The key of these graphs in inductor's on-disk cache, computed when a compile first asks for it (the
        passes that add constants do: `PackLinears.uuid`, `MergeSiblingLinears.uuid`); None: not cached."""
        if self.digest is None:
            modules = tuple(ref() for ref in self.modules)
            self.digest = "" if None in modules else (weights_fingerprint(modules) or "")
        return self.digest or None


_BY_MODEL: weakref.WeakKeyDictionary[nn.Module, _ModelGraphs] = weakref.WeakKeyDictionary()
_DIGESTS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str]] = weakref.WeakKeyDictionary()  # weights_fingerprint's
MAX_CACHED_BYTES = 512 * 2**20  # weights a cached graph may freeze (its cache entry keeps their packed copy)


def compiled_for(model: nn.Module, function: Callable, key: Hashable, compile: Callable[[Callable], Callable],
                 companions: tuple[nn.Module, ...] = ()) -> Callable:
    """`compile(copy of function)` for `model`, made once per `key` while `model`'s weights stay as they are; a
    function that also reads other modules' weights (an EAGLE head reads its target's LM head) names them as
    `companions`, and its graphs are kept only while those same modules' weights stay as they are too."""
    known = _graphs(model, companions)
    if key not in known.functions:
        known.functions[key] = _keyed(compile(own_code(function)), known.fingerprint)
    return known.functions[key]


def panels_for(model: nn.Module) -> LinearPanels | None:
    """`model`'s Linears packed once while its weights stay as they are (`kernels.linear_panels.LinearPanels`),
    shared by every engine on it, as the graphs traced over them are; None where none packs."""
    known = _graphs(model, ())
    if known.panels is False:
        known.panels = LinearPanels.pack(model)
    return known.panels


def _graphs(model: nn.Module, companions: tuple[nn.Module, ...]) -> _ModelGraphs:
    """What is kept for `model` (with `companions`), anew where their weights changed."""
    signature = tuple(weights_signature(module) for module in (model, *companions))
    known = _BY_MODEL.get(model)
    if known is None or not known.holds(signature, companions):
        known = _BY_MODEL[model] = _ModelGraphs(signature, tuple(map(weakref.ref, (model, *companions))))
    return known


def _keyed(compiled: Callable, fingerprint: Callable[[], str | None]) -> Callable:
    """`compiled`, each call of it (where its graphs compile) with `fingerprint` of the weights they freeze at
    hand (weak references only: the graphs kept per model never keep the model alive)."""

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        token = FROZEN_WEIGHTS.set(fingerprint)
        try:
            return compiled(*args, **kwargs)
        finally:
            FROZEN_WEIGHTS.reset(token)

    return call


def weights_fingerprint(modules: tuple[nn.Module, ...]) -> str | None:
    """A digest of every parameter and buffer of `modules` (names, dtypes, shapes, bytes), kept per module while
    its weights stay as they are (`weights_signature`); None when they hold more than `MAX_CACHED_BYTES` (a cache
    entry keeps a packed copy of them: larger models compile in every process instead of writing that copy per
    graph)."""
    tensors = [t for module in modules for t in (*module.parameters(), *module.buffers())]
    if sum(t.numel() * t.element_size() for t in tensors) > MAX_CACHED_BYTES:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for module in modules:
        digest.update(_module_digest(module).encode())
    return digest.hexdigest()


def _module_digest(module: nn.Module) -> str:
    signature = weights_signature(module)
    known = _DIGESTS.get(module)
    if known is not None and known[0] == signature:
        return known[1]
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    _DIGESTS[module] = (signature, digest.hexdigest())
    return _DIGESTS[module][1]


def step_graph_settings(freeze: bool, dtype: torch.dtype | None = None):
    """The config patch hf_accel's step graphs compile under. With `freeze`, the weights frozen into the graphs
    (inductor's `freezing`): for a model of `dtype` float32 their Linears run over weights packed in column panels
    (`kernels/packed_linear.py`: CPU graphs of a few rows each; other dtypes keep oneDNN's packing), and each group of
    sibling quantized Linears runs as one call (`quant.sibling_linears`), unless a custom pre-pass is set. Always: no
    assert of each input's and each custom op's output's sizes, strides and alignment at every call (about a
    microsecond each, one per input or op: up to a tenth of a small model's step; dynamo's guards check the inputs,
    and hf_accel's ops return the shapes their fake implementations state), and the graph's own C++ kernels (norms,
    rotary embeddings, activations) on one thread: at a step's few rows each does less work than a parallel region
    costs to open and join, where hf_accel's ops and the matmuls keep torch's threads. Inductor reads it when a graph
    is compiled, so it goes around the calls that compile; `torch.compile(options={"freezing": True})` does not reach
    it."""
    merge = {"post_grad_custom_pre_pass": MergeSiblingLinears()} if freeze and \
        inductor_config.post_grad_custom_pre_pass is None else {}
    return inductor_config.patch(freezing=freeze, size_asserts=False, alignment_asserts=False, **{"cpp.threads": 1},
                                 **merge, **packed_linear_settings(freeze and dtype == torch.float32))


def weights_signature(model: nn.Module) -> tuple:
    """Where each parameter and buffer of `model` lies and how often it was changed in place."""
    return tuple((tensor.data_ptr(), _version(tensor)) for tensor in (*model.parameters(), *model.buffers()))


def _version(tensor: torch.Tensor) -> int:
    # inference tensors keep no version counter (and cannot be changed in place outside inference mode)
    return -1 if tensor.is_inference() else tensor._version


def own_code(function: Callable) -> Callable:
    """A copy of `function` with a code object of its own, so dynamo keeps the graphs it compiles apart from every
    other copy's."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
