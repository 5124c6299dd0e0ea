"""CUDA graphs for compiled generate's decode step (a GPU and `compile_config.mode="reduce-overhead"`, the
`CompileConfig` default).

inductor's own CUDA graphs (its cudagraph trees) do not fit this step: the K/V pool is an input written in place, so
they skip the graph, and with torch 2.11's graph partitions the partitioned code failed to run (a size symbol missing
from a partition's arguments; docs/caches.md). So the step is compiled in inductor's default mode (fused kernels, no
graphs: `step.inductor_mode`), and the decode loop captures that compiled step once per `generate` call into one CUDA
graph over static token and position buffers, then replays it for every later token, as the engine's decode graphs do
(`runtime/cuda_graphs.py`). Everything else the step reads (the pool, the block table, the sink window) keeps its
address for the whole call.

Compiled speculation's forwards (the target's verify of 1 + k tokens per row, its plain step, a draft model's and
an EAGLE head's passes) are captured the same way, one graph per input shape (`CapturedSteps`), once a shape has
recurred: a capture costs two runs and the capture itself, so capturing every shape at its first use made compiled
`ngram_generate` (whose k varies widely) slower than not capturing, while draft and EAGLE rounds (k moves by one or
two) gained (docs/gpu_check.md has the measurements). Sampled steps draw inside their graphs from the default generator,
whose offsets CUDA graphs advance per replay; the warm-up runs draw too, so a seeded sampled call on a GPU gives other
(equally distributed) tokens than the same call without graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CapturedStep:
    """`step(*inputs) -> output` (a tensor, or a tuple of tensors and Nones), captured at its first inputs and
    replayed after: a call copies its inputs into the captured ones (same shapes) and returns a copy of the output."""

    def __init__(self, step: Callable[..., Any], *inputs: torch.Tensor):
        self.inputs = tuple(t.clone() for t in inputs)
        device = inputs[0].device
        # two runs on a side stream first (compiling and warming the allocator), as CUDA graphs require; a run at
        # the first inputs writes the K/V the first replay writes again, so it changes nothing
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        for captured, given in zip(self.inputs, inputs, strict=True):
            captured.copy_(given)
        self.graph.replay()
        # the next replay overwrites `out`
        if isinstance(self.out, tuple):
            return tuple(None if t is None else t.clone() for t in self.out)
        return self.out.clone()


CAPTURE_AT = 3  # the call with given shapes at which `CapturedSteps` captures them


class CapturedSteps:
    """`step(*inputs)` captured once per shapes of its tensor inputs (a `CapturedStep` each, its own memory pool) at
    the `CAPTURE_AT`-th call with those shapes, and replayed after; earlier calls, and every call where `enabled` is
    False (off a GPU, or a mode without CUDA graphs), run `step` itself. Every other tensor the step reads must keep
    its address for as long as this object is used."""

    def __init__(self, step: Callable[..., Any], enabled: bool):
        self.step, self.enabled = step, enabled
        self.graphs: dict[tuple[tuple[int, ...], ...], CapturedStep] = {}
        self.calls: dict[tuple[tuple[int, ...], ...], int] = {}

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if not self.enabled:
            return self.step(*inputs)
        shapes = tuple(tuple(t.shape) for t in inputs)
        graph = self.graphs.get(shapes)
        if graph is None:
            self.calls[shapes] = calls = self.calls.get(shapes, 0) + 1
            if calls < CAPTURE_AT:
                return self.step(*inputs)
            graph = self.graphs[shapes] = CapturedStep(self.step, *inputs)
        return graph(*inputs)


def captures(device: torch.device, mode: str | None) -> bool:
    """Whether a decode loop on `device` compiled with `mode` replays a captured graph (the modes that would give
    inductor's own CUDA graphs: "reduce-overhead", "max-autotune")."""
    return device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")
