"""Which Linears run over packed column panels, their forwards over those panels, and the panels an engine keeps.

`eligible` Linears: exactly `nn.Linear` (not a subclass or a quantized layer) whose weight is a plain fp32 CPU tensor
(not a tensor subclass, as torchao's quantized weights are) and whose forward is not already replaced on the instance
(accelerate's hooks, another caller's panels), outside any module tree holding a compiled module (`module.compile()`,
a compiled `forward`: dynamo would trace the replaced forwards and recompile on every call). `packed_forward` computes
`F.linear` over the panels with `torch.ops.hf_accel.packed_linear` (equal up to float rounding: another summation
order).

Two kinds of callers set those forwards on the Linears' instances, each only while it runs, so the model is left as it
was between calls: eager loops pack for the length of one call (`eager_packing.py`); an engine's steps pack once and
keep the panels (`LinearPanels`, one per model and its weights: `runtime.frozen_graphs.panels_for`), and its steps,
eager or compiled, run with them set (`installed`; the engine holds them for a run of steps, as it holds its attention
switch). An engine's panels lie in one buffer, each Linear's at an offset, and its forwards call
`hf_accel::panel_linear(x, buffer, offset, weight, bias)` with the Linear's own parameters. Dynamo traces that with
the buffer and the weights as inputs of the graph, not constants frozen into it: such graphs hold no weight, so a
step compiled over them can be saved whole and loaded by a new process on any weights of the same shapes
(`runtime/saved_steps.py`). One buffer and no view per Linear: each input and each view costs a graph every call,
~1 us, and a small model's step has ~60 Linears.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch._dynamo.utils import counters

from .custom_ops import panel_linear_kernel
from .packed_linear import PANEL, pack_weight


def eligible(modules: Iterable[nn.Module | None]) -> list[nn.Linear]:
    """Each eligible Linear of `modules` once (a module shared by two of them is packed once; None entries skipped);
    none under a compiled tree."""
    found: dict[int, nn.Linear] = {}
    for module in modules:
        if module is None or _compiled(module):
            continue
        for sub in module.modules():
            if type(sub) is nn.Linear and "forward" not in sub.__dict__ and _plain_fp32_cpu(sub.weight):
                found.setdefault(id(sub), sub)
    return list(found.values())


def packed_forward(kernel: Callable[..., torch.Tensor], linear: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear`'s forward over its weight's panels (packed now)."""
    weight = linear.weight.detach().t()  # [in, out]: the matmul's right operand as it lies
    return functools.partial(_panels_forward, kernel, pack_weight(weight), weight, linear.bias)


class LinearPanels:
    """A model's eligible Linears packed once, with their forwards over the panels, set on the instances while
    `installed` (nested and from several threads: set at the first entry, removed at the last exit)."""

    def __init__(self, forwards: list[tuple[nn.Linear, Callable]], layout: list[tuple[str, int]]):
        self.forwards = forwards
        self.layout = layout  # each packed Linear by name, with where its panels start in the buffer
        self._lock = threading.Lock()
        self._depth = 0

    @classmethod
    def pack(cls, model: nn.Module) -> LinearPanels | None:
        """`model`'s eligible Linears packed into one buffer (one more copy of their weights, as graphs that freeze
        them keep); None where none is eligible, or without the kernel."""
        kernel = panel_linear_kernel()
        linears = [] if kernel is None else eligible((model,))
        if not linears:
            return None
        sizes = [-(-linear.out_features // PANEL) * PANEL * linear.in_features for linear in linears]
        starts = list(itertools.accumulate(sizes, initial=0))
        with torch.no_grad():
            flat = torch.empty(sum(sizes), dtype=torch.float32)  # every Linear's panels, one after the other
            forwards = []
            for linear, start, size in zip(linears, starts, sizes):
                flat[start:start + size].view(-1, linear.in_features, PANEL).copy_(
                    pack_weight(linear.weight.detach().t()))
                forwards.append((linear, functools.partial(_flat_forward, kernel, flat, start, linear.weight,
                                                           linear.bias)))
        counters["hf_accel"]["packed_linears"] += len(linears)  # as the graph pass counts those it packs
        names = {id(module): name for name, module in model.named_modules()}
        return cls(forwards, [(names[id(linear)], start) for linear, start in zip(linears, starts)])

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within: the Linears run over their panels (a Linear whose forward another caller replaced meanwhile keeps
        that one)."""
        with self._lock:
            if self._depth == 0:  # the instance dicts directly: a step pays microseconds, not Module.__setattr__'s
                for linear, forward in self.forwards:
                    linear.__dict__.setdefault("forward", forward)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for linear, forward in self.forwards:
                        if linear.__dict__.get("forward") is forward:
                            del linear.__dict__["forward"]


def _plain_fp32_cpu(weight: torch.Tensor) -> bool:
    """A plain tensor (not a subclass with its own matmul, as torchao's quantized weights are), fp32, on the CPU."""
    return type(weight.data) is torch.Tensor and weight.dtype == torch.float32 and weight.device.type == "cpu"


def _compiled(module: nn.Module) -> bool:
    """Whether any module of the tree is compiled (`nn.Module.compile`) or has a replaced non-Linear forward (a
    `torch.compile`d `forward`, a wrapper): its graphs would trace the packed forwards."""
    return any(getattr(sub, "_compiled_call_impl", None) is not None
               or ("forward" in sub.__dict__ and type(sub) is not nn.Linear) for sub in module.modules())


def _panels_forward(kernel: Callable[..., torch.Tensor], panels: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, input: torch.Tensor) -> torch.Tensor:
    """`F.linear(input, weight.T, bias)` for `input` `[..., in]` over `panels` `[ceil(out / 16), in, 16]` ->
    `[..., out]` (named as `nn.Linear.forward` names it)."""
    out = kernel(input.reshape(-1, input.shape[-1]), panels, weight, bias)
    return out.view(*input.shape[:-1], out.shape[-1])


def _flat_forward(kernel: Callable[..., torch.Tensor], flat: torch.Tensor, start: int, weight: nn.Parameter,
                  bias: nn.Parameter | None, input: torch.Tensor) -> torch.Tensor:
    """`F.linear(input, weight, bias)` for `input` `[..., in]` over the panels at `flat[start:]` -> `[..., out]`
    (`hf_accel::panel_linear`). One buffer and the Linear's own parameters: a graph traced over it takes one input
    for all the panels and no view of each (every input and every view costs each call of the graph)."""
    out = kernel(input.reshape(-1, input.shape[-1]), flat, start, weight, bias)
    return out.view(*input.shape[:-1], out.shape[-1])
