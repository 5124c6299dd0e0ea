"""benchmarks/bench_compile.py --quick: every row runs, each compiled row gives its eager row's tokens, nothing is
added to dynamo's graphs while timed, the speculative rows (ngram eager and compiled, draft compiled) give plain
compiled greedy's tokens on open and copy-heavy prompts, and the page and JSON are written with the llama.cpp row
skipped (no build)."""

import json

import pytest

pytestmark = pytest.mark.compiled


def test_quick_run_writes_its_tables(load_benchmark, tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    monkeypatch.delenv("HF_ACCEL_LLAMA_GGUF", raising=False)
    report = load_benchmark("bench_compile").main(["--quick", "--out", str(tmp_path)])
    for scenario in report["scenarios"]:
        names = [r["name"] for r in scenario["results"]]
        assert names[0] == "DynamicCache" and "hf_accel paged + compile" in names and "hf_accel sink + compile" in names
        assert scenario["same_as_eager"] == {"hf_accel paged + compile": True, "hf_accel sink + compile": True,
                                             "hf_accel int4 KV + compile": True}
        assert scenario["graphs_added_while_timed"] == 0
        assert all(r["decode_tokens_per_s"] > 0 for r in scenario["results"])
        assert set(scenario["compile_seconds"]) == {"StaticCache + compile", "hf_accel paged + compile",
                                                    "hf_accel sink + compile", "hf_accel int4 KV + compile"}
    assert [section["prompts"] for section in report["speculative"]] == ["open continuation", "copy-heavy"]
    for section in report["speculative"]:
        assert [r["name"] for r in section["results"]] == ["plain + compile", "ngram eager", "ngram + compile",
                                                           "draft + compile"]
        assert all(r["agreement"] == 1.0 and r["decode_tokens_per_s"] > 0 for r in section["results"])
    assert report["speculative"][1]["tokens_per_forward"]["ngram + compile"] > 1  # copy-heavy: drafts accepted
    assert "skipped" in report["llama_cpp"]
    assert all(report["verify_cost"][key] > 0 for key in ("decode_ms", "verify_5_ms", "verify_9_ms", "tree_9_ms"))
    saved = json.loads((tmp_path / "benchmarks/results/bench_compile.json").read_text())
    assert saved["scenarios"][0]["scenario"] == report["scenarios"][0]["scenario"]
    page = (tmp_path / "docs/bench_compile.md").read_text()
    assert "| hf_accel paged + compile |" in page and "| draft + compile |" in page and "llama.cpp" in page
