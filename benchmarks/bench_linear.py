"""Why hf_accel's compiled steps freeze the weights and run their fp32 Linears over packed panels: a Linear at a few
rows, MKL's sgemm over the weight as it lies (what eager PyTorch and an unfrozen compiled graph call), oneDNN's matmul
over the same weight packed once (what inductor's `freezing` compiles by itself) and hf_accel's `packed_linear` over
the weight packed in 16-column panels (what hf_accel's compiled CPU steps run: `kernels/packed_linear.py`).

Method: the Linear shapes of the reference target (hidden 256) and of the 185M Llama of bench_vllm_peer (hidden
1024), at 1, 5, 9, 64 and 512 rows (a decode, speculative verify forwards of 1 + 4 and 1 + 8 tokens, an engine decode
batch, a prefill chunk); fp32, one thread; the three calls interleaved (`bench.time_interleaved`), median of
repeats. The outputs agree to fp32 rounding (checked). Without the hf_accel kernels the panels column is skipped.

Regenerate benchmarks/results/bench_linear.json and docs/bench_linear.md:
    .venv/bin/python benchmarks/bench_linear.py
Smoke run (small shapes, prints only unless --out is given):
    .venv/bin/python benchmarks/bench_linear.py --quick
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_accel.bench.output import hardware, run_benchmark
from hf_accel.bench.timing import time_interleaved
from hf_accel.kernels.packed_linear import pack_weight
from hf_accel.kernels.custom_ops import packed_linear_kernel

ROOT = Path(__file__).resolve().parents[1]
NAME = "bench_linear"
COMMAND = ".venv/bin/python benchmarks/bench_linear.py"
SIDES = ("sgemm", "packed", "panels")


@dataclass(frozen=True, slots=True)
class Plan:
    models: dict[str, dict[str, tuple[int, int]]]  # model -> Linear name -> (in_features, out_features)
    rows: tuple[int, ...]
    calls: int  # per timing
    repeats: int


FULL = Plan(models={
    "reference target (hidden 256)": {"q_proj": (256, 256), "gate_proj": (256, 768), "down_proj": (768, 256),
                                      "lm_head": (256, 4096)},
    "185M Llama (hidden 1024)": {"q_proj": (1024, 1024), "gate_proj": (1024, 2816), "down_proj": (2816, 1024),
                                 "lm_head": (1024, 4096)},
}, rows=(1, 5, 9, 64, 512), calls=50, repeats=5)
QUICK = Plan(models={"tiny (hidden 64)": {"q_proj": (64, 64), "lm_head": (64, 512)}}, rows=(1, 9), calls=3, repeats=1)


def packed_linear(weight: torch.Tensor, rows: int):
    """`x @ weight.T` through oneDNN over `weight` packed once for `rows`-row inputs, as inductor's freezing does."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def panel_linear(weight: torch.Tensor):
    """`x @ weight.T` through hf_accel's `packed_linear` over `weight` packed in panels once, as hf_accel's compiled
    CPU steps run it; None without the kernel."""
    kernel = packed_linear_kernel()
    if kernel is None:
        return None
    right = weight.t()  # [K, N]: the matmul's operand as a frozen graph holds it
    panels = pack_weight(right)
    return lambda x: kernel(x, panels, right, None)


def time_shape(in_features: int, out_features: int, rows: int, plan: Plan) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
    x = torch.randn(rows, in_features, generator=generator)
    packed, panels = packed_linear(weight, rows), panel_linear(weight)
    calls = {"sgemm": lambda: torch.nn.functional.linear(x, weight), "packed": lambda: packed(x)}
    if panels is not None:
        calls["panels"] = lambda: panels(x)
    for side in calls:
        torch.testing.assert_close(calls[side](), calls["sgemm"](), rtol=1e-4, atol=1e-4)

    def measure(side: str) -> tuple[float, None]:
        started = time.perf_counter()
        for _ in range(plan.calls):
            calls[side]()
        return (time.perf_counter() - started) / plan.calls * 1e6, None

    timings = time_interleaved(list(calls), measure, plan.repeats)
    us = {side: statistics.median(timings.seconds[side]) for side in calls}
    result = {"rows": rows, "sgemm_us": round(us["sgemm"], 1), "packed_us": round(us["packed"], 1),
              "sgemm_over_packed": round(us["sgemm"] / us["packed"], 2)}
    if "panels" in us:
        result |= {"panels_us": round(us["panels"], 1), "packed_over_panels": round(us["packed"] / us["panels"], 2)}
    return result


def measure(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    results = []
    for model, shapes in plan.models.items():
        for name, (in_features, out_features) in shapes.items():
            for rows in plan.rows:
                results.append({"model": model, "linear": name, "in_features": in_features,
                                "out_features": out_features, **time_shape(in_features, out_features, rows, plan)})
    return {"benchmark": NAME, "command": COMMAND + (" --quick" if quick else ""), "hardware": hardware(),
            "plan": {"rows": list(plan.rows), "calls": plan.calls, "repeats": plan.repeats}, "results": results}


def render(report: dict[str, Any]) -> str:
    rows = report["plan"]["rows"]
    lines = ["A Linear (`x @ W.T`, fp32) at a few rows: MKL's sgemm over W as it lies (eager PyTorch, an unfrozen "
             "graph), oneDNN's matmul over W packed once (inductor's `freezing` by itself) and hf_accel's "
             "`packed_linear` over W packed in 16-column panels (what hf_accel's compiled CPU steps run); "
             f"{report['hardware']['torch_threads']} torch thread(s) ({report['hardware']['cpu']}), interleaved, "
             "median. Cells: sgemm / oneDNN / panels microseconds (oneDNN's time over the panels').", "",
             "| model | Linear (in -> out) | " + " | ".join(f"{n} rows" for n in rows) + " |",
             "| --- | --- |" + " --- |" * len(rows)]
    shapes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for result in report["results"]:
        shapes.setdefault((result["model"], result["linear"]), []).append(result)
    for (model, name), found in shapes.items():
        cells = [f"{r['sgemm_us']:.0f} / {r['packed_us']:.0f} / " + (
                     f"{r['panels_us']:.0f} ({r['packed_over_panels']:.2f}x)" if "panels_us" in r else "-")
                 for r in found]
        size = f"{found[0]['in_features']} -> {found[0]['out_features']}"
        lines.append(f"| {model} | {name} ({size}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nFrom `{report['command']}`.\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_benchmark(argv, __doc__.split("\n\n")[0], NAME, ROOT, measure, render)


if __name__ == "__main__":
    main(sys.argv[1:])
