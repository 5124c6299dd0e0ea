"""benchmarks/bench_sink.py runs end to end (tiny model, a few seconds), and the eager cache comparison
(`bench.STRATEGIES`, bench_paged's rows) has a sink row."""

import json

from hf_accel import bench



def test_bench_sink_quick_writes_json_and_markdown(tmp_path, load_benchmark):
    script = load_benchmark("bench_sink")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/caches.md").write_text("a\n<!-- bench_sink:start -->\nold\n<!-- bench_sink:end -->\nb\n")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_sink.json").read_text())
    memory = report["stream"]["kv_bytes"]
    assert memory["sink"]["10x"] == memory["sink"]["1x"] and memory["DynamicCache"]["10x"] > memory["sink"]["10x"]
    assert [r["name"] for r in report["perplexity"]["results"]][:3] == [
        "in-window (recomputed on the last window)", "sink cache (4 sinks)", "plain window (0 sinks)"]
    doc = (tmp_path / "docs/caches.md").read_text()
    assert "old" not in doc and "| sink |" in doc and doc.startswith("a\n") and doc.endswith("b\n")


def test_the_cache_comparison_has_a_sink_row():
    sink = next(s for s in bench.STRATEGIES if s.name == "hf_accel sink")
    assert sink.generate_kwargs(None, 576) == {
        "cache_implementation": "sink", "cache_config": {"window_length": 288, "num_sink_tokens": 4}}
