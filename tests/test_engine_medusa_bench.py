"""benchmarks/bench_engine_medusa.py runs end to end (a smoke run) and writes its results and the docs table."""

import json


def test_bench_engine_medusa_quick_writes_json_markdown_and_the_docs_table(tmp_path, load_benchmark):
    script = load_benchmark("bench_engine_medusa")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/serving.md").write_text(
        "a\n<!-- bench_engine_medusa:start -->\nold\n<!-- bench_engine_medusa:end -->\n")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_engine_medusa.json").read_text())
    assert set(report["results"]) == {"1", "2"}
    for results in report["results"].values():
        assert set(results) == {script.PLAIN, script.DEFAULT, "heads, k=2 always"}
        assert all(r["tokens_per_s"] > 0 for r in results.values())
        assert results[script.PLAIN]["mean_tokens_per_speculating_step"] is None
        assert results["heads, k=2 always"]["mean_tokens_per_speculating_step"] >= 1.0
    doc = (tmp_path / "docs/serving.md").read_text()
    assert "old" not in doc and "| concurrent requests | plain tok/s |" in doc
    assert (tmp_path / "docs/bench_engine_medusa.md").read_text().startswith("# Engine Medusa benchmark")
