"""benchmarks/bench_prefix_store.py runs end to end (reference draft, 4 calls) and writes its JSON, its page and the
headline between the markers of the docs that quote it."""

import json


def test_bench_prefix_store_quick_writes_json_and_markdown(tmp_path, load_benchmark):
    script = load_benchmark("bench_prefix_store")
    (tmp_path / "docs").mkdir()
    marked = "a\n<!-- bench_prefix_store:start -->\nold\n<!-- bench_prefix_store:end -->\nb\n"
    (tmp_path / "docs/caches.md").write_text(marked)
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_prefix_store.json").read_text())
    assert set(report["summary"]) == {"DynamicCache", "paged", "paged + PrefixStore"}
    (measured,) = report["rounds"]
    assert measured["identical_calls"] == 4  # every call's tokens agree across the three strategies
    store = measured["store"]
    assert store["hits"] == 3 and store["misses"] == 1 and store["tokens_saved"] == 3 * 48  # the header, 3 times
    assert all(len(measured[key][name]) == 4 for key in ("prefill_s", "ttft_s") for name in report["summary"])
    doc = (tmp_path / "docs/caches.md").read_text()
    assert "old" not in doc and "| paged + PrefixStore |" in doc and doc.startswith("a\n") and doc.endswith("b\n")
    assert "# Prefix store benchmark" in (tmp_path / "docs/bench_prefix_store.md").read_text()
