"""benchmarks/bench_quantized_kv.py runs end to end in its quick plan and writes its JSON and markdown."""

import json


def test_quick_run_writes_json_markdown_and_target_rows(tmp_path, load_benchmark):
    script = load_benchmark("bench_quantized_kv")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/caches.md").write_text("x\n<!-- bench_quantized_kv:start -->\nold\n<!-- bench_quantized_kv:end -->\n")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_quantized_kv.json").read_text())
    memory = {r["name"]: r for r in report["memory"]["results"]}
    assert memory["hf_accel int2"]["end_bytes"] < memory["hf_accel int4"]["end_bytes"] < memory["hf_accel int8"]["end_bytes"]
    assert memory["hf_accel int8"]["end_ratio"] < 1.0
    assert [s["context"] for s in report["speed"]] == list(script.QUICK.speed_contexts)
    assert set(report["quality"]["perplexity"]) == {"DynamicCache", "hf_accel int8", "hf_accel int4", "hf_accel int2",
                                                    "hf_accel int4 no fp sinks", "hf_accel int2 no fp sinks"}
    assert set(report["quality"]["greedy_agreement"]) == set(report["quality"]["perplexity"]) - {"DynamicCache"}
    assert "hf_accel int4 no fp sinks" in memory
    assert {r["name"] for r in report["speed"][0]["results"]} >= {"hf_accel int4", "hf_accel int4 no fp sinks"}
    assert "| hf_accel int4 |" in (tmp_path / "docs/bench_quantized_kv.md").read_text()
    assert "perplexity increase" in (tmp_path / "docs/caches.md").read_text()
