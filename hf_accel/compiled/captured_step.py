"""CUDA graphs for compiled generate's decode step (a GPU and `compile_config.mode="reduce-overhead"`, the
`CompileConfig` default).

inductor's own CUDA graphs (its cudagraph trees) do not fit this step: the K/V pool is an input written in place, so
they skip the graph, and with torch 2.11's graph partitions the partitioned code failed to run (a size symbol missing
from a partition's arguments; seen on an H100). So the step is compiled in inductor's default mode (fused kernels, no
graphs: `step.inductor_mode`), and the decode loop captures that compiled step once per `generate` call into one CUDA
graph over static token and position buffers, then replays it for every later token, as the engine's decode graphs do
(`engine/cuda_graphs.py`). Everything else the step reads (the pool, the block table, the sink window) keeps its
address for the whole call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CapturedStep:
    """`step(tokens [rows], positions [rows]) -> tensor`, captured at its first inputs and replayed after."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                 positions: torch.Tensor):
        self.tokens, self.positions = tokens.clone(), positions.clone()
        device = tokens.device
        # two runs on a side stream first (compiling and warming the allocator), as CUDA graphs require; a run at
        # the first inputs writes the K/V the first replay writes again, so it changes nothing
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(self.tokens, self.positions)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step(self.tokens, self.positions)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites `out`


def captures(device: torch.device, mode: str | None) -> bool:
    """Whether a decode loop on `device` compiled with `mode` replays a captured graph (the modes that would give
    inductor's own CUDA graphs: "reduce-overhead", "max-autotune")."""
    return device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")
