"""benchmarks/bench_serving.py runs end to end on the reference draft (a smoke run) and writes its results."""

import json


def test_bench_serving_quick_writes_json_markdown_and_the_docs_table(tmp_path, load_benchmark):
    script = load_benchmark("bench_serving")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/serving.md").write_text("a\n<!-- bench_serving:start -->\nold\n<!-- bench_serving:end -->\n")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_serving.json").read_text())
    rates = report["offline"]["tokens_per_s"]
    assert set(rates) == {"sequential generate", "static batches of 8", "transformers CB", "hf_accel Engine"}
    assert all(rate > 0 for rate in rates.values())
    equality = report["offline"]["equality"]
    assert equality["identical"] + len(equality["first_difference_top2_gaps"]) == equality["requests"]
    assert all(gap < 1e-4 for gap in equality["first_difference_top2_gaps"])
    assert set(report["max_num_seqs_sweep"]) == {"1", "4"} and set(report["prefix_caching"]) == {"with", "without"}
    online = report["online"]
    assert [r["rate"] for r in online] == [8.0, "inf"] and all(r["requests"] == 4 for r in online)
    assert all(r["output_token_throughput"] > 0 and r["ttft_ms"]["median"] > 0 for r in online)
    doc = (tmp_path / "docs/serving.md").read_text()
    assert "old" not in doc and "| hf_accel Engine |" in doc
    assert (tmp_path / "docs/bench_serving.png").stat().st_size > 1000  # the throughput plot
