"""The memory read bandwidth that bounds a weight-streaming decode, for `bench_size.py`.

A probe (`probe`) reads 1 GiB of fp32 with torch's own kernels, on transparent huge pages as hf_accel's quantized
panels are (`kernels.custom_ops.on_huge_pages`: on 4 KiB pages a virtual machine's page walks held plain reads to
60% of the rate; llama.cpp's mmap'd GGUF gets large pages from the page cache); on some machines it falls short of
what a decode reads (torch's sum and matrix-vector product need not scale with threads as a decode's kernels do). An
fp32 decode of a model larger than the probe's buffer reads nothing but its weights, once a token, so its rate is a
read rate the machine sustains: the limit at a thread count is the faster of the probe and those decodes (`limits`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hf_accel.bench.timing import torch_threads
from hf_accel.kernels.custom_ops import on_huge_pages

PROBE_BYTES = 2**30


def probe(threads: int, nbytes: int = PROBE_BYTES) -> float:
    """Bytes/s read from memory on `threads` threads: the faster of a sum over `nbytes` (1 GiB) of fp32 and a
    matrix-vector product over it (MKL's sgemv keeps more reads in flight), best of 3 each."""
    data = on_huge_pages(torch.ones(nbytes // 4))
    side = int(data.numel() ** 0.5)
    matrix, vector = data.view(side, side), torch.ones(side)
    with torch_threads(threads):
        rates = []
        for run in (data.sum, lambda: torch.mv(matrix, vector)):
            run()
            rates.append(data.nbytes / min(_timed(run) for _ in range(3)))
    return max(rates)


def limits(probed: dict[int, float], sizes: list[dict[str, Any]]) -> dict[int, float]:
    """Per thread count, the faster of the probe and the fp32 decode rows (either tool) of models whose fp32 weights
    are at least the probe's 1 GiB (tokens/s x bytes a token)."""
    found = dict(probed)
    for size in sizes:
        for row in size["rows"]:
            if row["format"] == "fp32" and row["bytes_per_token"] >= PROBE_BYTES:
                read = row["tokens_per_s"] * row["bytes_per_token"]
                found[row["threads"]] = max(found[row["threads"]], read)
    return found


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
