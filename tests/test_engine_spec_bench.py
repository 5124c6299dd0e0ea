"""benchmarks/bench_engine_spec.py runs end to end (a smoke run) and writes its results and the docs tables."""

import json


def test_bench_engine_spec_quick_writes_json_markdown_and_the_docs_tables(tmp_path, load_benchmark):
    script = load_benchmark("bench_engine_spec")
    (tmp_path / "docs").mkdir()
    for page in ("serving.md", "speculative.md"):
        (tmp_path / "docs" / page).write_text("a\n<!-- bench_engine_spec:start -->\nold\n<!-- bench_engine_spec:end -->\n")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_engine_spec.json").read_text())
    assert set(report["results"]) == set(script.WORKLOADS)
    suffix_gains = []
    for by_concurrency in report["results"].values():
        assert set(by_concurrency) == {"1", "2"}
        for results in by_concurrency.values():
            assert set(results) == {script.PLAIN, script.SUFFIX, script.EAGLE3, script.DRAFT}
            assert all(r["tokens_per_s"] > 0 for r in results.values())
            assert results[script.PLAIN]["mean_tokens_per_speculating_step"] is None
            for method in (script.EAGLE3, script.DRAFT):
                assert results[method]["mean_tokens_per_speculating_step"] >= 1.0  # it speculated
            suffix_gains.append(results[script.SUFFIX]["mean_tokens_per_speculating_step"])
    # suffix speculates where its measured step costs say it pays (DraftBudget's off-switch): on a loaded machine a
    # cell of a 12-token smoke run may decode plainly throughout, but not every cell
    assert any(gain is not None and gain >= 1.0 for gain in suffix_gains)
    assert all(gain is None or gain >= 1.0 for gain in suffix_gains)
    assert set(report["targets"]) == {"open, 1 requests", "copy-heavy, 1 requests"}
    for page in ("serving.md", "speculative.md"):
        doc = (tmp_path / "docs" / page).read_text()
        assert "old" not in doc and "| workload | concurrent requests | plain tok/s | suffix tok/s |" in doc
    assert (tmp_path / "docs/bench_engine_spec.md").read_text().startswith("# Engine speculation benchmark")
