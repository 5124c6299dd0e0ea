"""benchmarks/bench_linear.py runs end to end on small shapes (a smoke run): both sides agree, every shape and row
count is timed, and the docs table is written."""

import json

from hf_accel.kernels.custom_ops import packed_linear_kernel


def test_bench_linear_quick_times_every_shape_and_writes_the_table(tmp_path, load_benchmark):
    script = load_benchmark("bench_linear")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_linear.json").read_text())
    assert [(r["linear"], r["rows"]) for r in report["results"]] == [("q_proj", 1), ("q_proj", 9),
                                                                     ("lm_head", 1), ("lm_head", 9)]
    assert all(r["sgemm_us"] > 0 and r["packed_us"] > 0 for r in report["results"])
    # hf_accel's panels: timed wherever its kernels are built
    assert all(r["panels_us"] > 0 for r in report["results"]) or packed_linear_kernel() is None
    table = (tmp_path / "docs/bench_linear.md").read_text()
    assert "| tiny (hidden 64) | lm_head (64 -> 512) |" in table
