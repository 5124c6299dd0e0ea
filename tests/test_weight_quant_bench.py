"""benchmarks/bench_weight_quant.py: targets and tables from a report, and a --quick run end to end (JSON, markdown,
the marked section of docs/weight-quantization.md)."""

import json

import pytest


@pytest.fixture
def script(load_benchmark):
    return load_benchmark("bench_weight_quant")


def _scenario(script, speeds, ppl, int8_vs_bnb, num_params):
    results = [{"name": v.name, "weight_bytes": 100, "decode_tokens_per_s": 10.0,
                "speed_vs_fp32": speeds.get(v.name, 1.0), "perplexity": ppl and ppl.get(v.name, 10.0)}
               for v in script.VARIANTS]
    return {"results": results, "int8_vs_bnb_int8": int8_vs_bnb, "num_params": num_params, "model_summary": "llama"}


def _report(script):
    return {"reference": _scenario(script, {"hf_accel int8": 0.9}, {"fp32": 10.0, "hf_accel int8": 10.05,
                                                                    "hf_accel int4": 10.6}, 3.2, 8.9e6),
            "large": _scenario(script, {"hf_accel int8": 1.6}, None, 2.5, 220e6), "command": script.COMMAND}


def test_targets_are_judged_on_each_model_where_they_apply(script):
    rows = script.target_rows(_report(script))
    assert [row[0].split("(")[1] for row in rows[:4]] == ["reference target, 8.9M params)"] * 2 + \
        ["random Llama, 220M params)"] * 2
    assert [row[1:] for row in rows] == [["0.90x", "**no**"], ["3.20x", "yes"], ["1.60x", "yes"], ["2.50x", "**no**"],
                                         ["+0.50%", "yes"], ["+6.00%", "**no**"]]


def test_tables_show_perplexity_only_where_it_was_measured(script):
    report = _report(script)
    assert "perplexity" in script.results_table(report["reference"]).splitlines()[0]
    assert "perplexity" not in script.results_table(report["large"]).splitlines()[0]
    assert "| fp32 | 100 B | 1.00x |" in script.results_table(report["large"])


def test_paired_ratio_is_the_median_of_per_repeat_ratios(script):
    assert script.paired_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 1.0]) == 4.0


def test_quick_run_writes_json_markdown_and_the_docs_section(script, tmp_path):
    doc = tmp_path / "docs" / "weight-quantization.md"
    doc.parent.mkdir()
    doc.write_text("head\n<!-- bench_weight_quant:start -->\nold\n<!-- bench_weight_quant:end -->\ntail\n")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_weight_quant.json").read_text())
    for key in ("reference", "large"):
        assert [r["name"] for r in report[key]["results"]] == [v.name for v in script.VARIANTS]
        assert all(r["decode_tokens_per_s"] > 0 and r["weight_bytes"] > 0 for r in report[key]["results"])
    assert all(r["perplexity"] > 1 for r in report["reference"]["results"])
    assert all(r["perplexity"] is None for r in report["large"]["results"])  # random weights: not measured
    text = (tmp_path / "docs/bench_weight_quant.md").read_text()
    assert "| hf_accel int8 |" in text and "--quick" in text
    section = doc.read_text()
    assert section.startswith("head\n<!-- bench_weight_quant:start -->\n| target |") and section.endswith("tail\n")
    assert "old" not in section
