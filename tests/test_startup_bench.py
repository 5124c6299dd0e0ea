"""benchmarks/bench_startup.py runs end to end (a smoke run: one import round, `hf-accel serve` eager, cold then
warm): every row is measured, the server answered, and the docs table is written."""

import json


def test_bench_startup_quick_measures_every_row_and_writes_the_table(tmp_path, load_benchmark):
    script = load_benchmark("bench_startup")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_startup.json").read_text())
    imports = report["imports"]
    assert 0 < imports["transformers_user_imports_s"] < imports["with_hf_accel_s"]
    assert imports["ratio"] == imports["with_hf_accel_s"] / imports["transformers_user_imports_s"]
    [row] = report["serve"].values()
    for start in ("cold", "warm"):
        assert 0 < row[start]["serving_s"] <= row[start]["ready_s"] and row[start]["first_request_s"] > 0
    table = (tmp_path / "docs/bench_startup.md").read_text()
    assert "| the same, then `import hf_accel` |" in table and "| hf_accel, eager (--enforce-eager) | warm |" in table
