"""How close the quantized Linear kernels alone come to the memory's read rate at real size: every int8 / int4 Linear
of a model called once at one row (a decode step's weight reads, without the step's attention, graph and Python),
against the read probe of bench_size.py, interleaved.

bench_size.py's share of the bandwidth is a whole decode step's: it mixes the kernels' reads with the time a step
spends outside them (at two threads a few ms of a 15-20 ms int4 step). This benchmark separates the two: a kernel
share near 100% puts what is missing in the step around the kernels; a low one in the kernels' own streaming.

Method: the 755M random-weight Llama of bench_size.py, int8 (per channel) and int4 (groups of 64) as bench_size
loads them (output layer in int8); a sweep calls `hf_accel::int8_linear` / `int4_linear` on every quantized Linear of
the model in module order (q, k, v, o, gate, up, down per layer, then the output layer: the panels stream from memory,
a sweep being over ten times the last-level cache), on a fixed random row; each repeat times a sweep of each format and the
probe (the faster of a sum and a matrix-vector product over 1 GiB on huge pages), one thread count at a time, after a
warm-up sweep. Share: the median of per-repeat ratios of a sweep's read rate to the probe's.

Regenerate benchmarks/results/bench_quant_stream.json and docs/bench_quant_stream.md:
    .venv/bin/python benchmarks/bench_quant_stream.py
Smoke run (a tiny model, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_quant_stream.py --quick
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hf_accel
from hf_accel.bench.output import hardware, run_benchmark
from hf_accel.bench.timing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_size  # noqa: E402
import read_bandwidth  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_quant_stream"
COMMAND = ".venv/bin/python benchmarks/bench_quant_stream.py"
FORMATS = ("int8", "int4")
FULL = {"size": bench_size.FULL.sizes[-1], "threads": (1, 2), "repeats": 7, "probe_bytes": read_bandwidth.PROBE_BYTES}
QUICK = {"size": bench_size.QUICK.sizes[-1], "threads": (1,), "repeats": 1, "probe_bytes": 2**26}


def sweep(model: torch.nn.Module) -> tuple[Callable[[], None], int]:
    """A call of every quantized Linear kernel of `model` at one row, and the bytes of weights those calls read."""
    calls, total = [], 0
    for module in model.modules():
        if isinstance(module, (hf_accel.Int4Linear, hf_accel.Int8Linear)) and module.layout == "panels":
            # the module's own kernel call, without nn.Module's call machinery around it
            calls.append(lambda module=module, row=torch.randn(1, module.in_features): module._matmul(row, True))
            total += sum(tensor.nbytes for tensor in bench_size.tensors_read(module))
    if not calls:
        raise RuntimeError("no quantized Linear runs on hf_accel's kernels here (a build without them?)")

    def run() -> None:
        with torch.inference_mode():
            for call in calls:
                call()

    return run, total


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder = bench_size.model_folder(plan["size"], Path(scratch) / "model")
        models = {fmt: bench_size.load(folder, fmt) for fmt in FORMATS}
        sweeps = {fmt: sweep(model) for fmt, model in models.items()}
        rows = []
        for threads in plan["threads"]:
            with torch_threads(threads):
                rates, probes = _interleaved(sweeps, plan)
            for fmt, (_, nbytes) in sweeps.items():
                shares = [rate / probe for rate, probe in zip(rates[fmt], probes)]
                rows.append({"format": fmt, "threads": threads, "bytes": nbytes,
                             "sweep_ms": 1000 * nbytes / statistics.median(rates[fmt]),
                             "read_gb_s": statistics.median(rates[fmt]) / 1e9,
                             "probe_gb_s": statistics.median(probes) / 1e9, "share": statistics.median(shares)})
    return {"command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(), "size": plan["size"].name,
            "repeats": plan["repeats"], "rows": rows, "total_seconds": time.perf_counter() - started}


def _interleaved(sweeps: dict[str, tuple[Callable[[], None], int]],
                 plan: dict[str, Any]) -> tuple[dict[str, list[float]], list[float]]:
    """Bytes/s per format and of the probe, per repeat, after a warm-up sweep of each format."""
    for run, _ in sweeps.values():
        run()
    rates: dict[str, list[float]] = {fmt: [] for fmt in sweeps}
    probes = []
    for _ in range(plan["repeats"]):
        for fmt, (run, nbytes) in sweeps.items():
            started = time.perf_counter()
            run()
            rates[fmt].append(nbytes / (time.perf_counter() - started))
        probes.append(read_bandwidth.probe(torch.get_num_threads(), plan["probe_bytes"]))
    return rates, probes


def render(report: dict[str, Any]) -> str:
    lines = ["# Quantized kernels alone against the memory's read rate", "",
             f"{report['hardware']['cpu']}; {report['size']}: every int8 / int4 Linear called once at one row (a "
             f"decode step's weight reads, without its attention, graph and Python), against the read probe of "
             f"bench_size, interleaved, median of {report['repeats']} repeats.", "",
             "| weights | threads | weights read | sweep (ms) | read rate (GB/s) | probe (GB/s) | share of the probe |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in sorted(report["rows"], key=lambda row: (row["threads"], row["format"])):
        lines.append(f"| {row['format']} | {row['threads']} | {row['bytes'] / 2**20:.0f} MiB | {row['sweep_ms']:.1f} "
                     f"| {row['read_gb_s']:.1f} | {row['probe_gb_s']:.1f} | {100 * row['share']:.0f}% |")
    return "\n".join(lines) + f"\n\nFrom `{report['command']}` ({report['total_seconds'] / 60:.1f} min in all).\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    description = __doc__.split("\n\n")[0]
    return run_benchmark(argv, description, NAME, ROOT, measure, render)


if __name__ == "__main__":
    main()
