"""benchmarks/bench_weight_quant.py: targets and tables from a report (the full run is too slow for the suite)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_weight_quant", ROOT / "benchmarks" / "bench_weight_quant.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _report(script):
    speeds = {"fp32": 1.0, "hf_accel int8": 1.6, "bnb int8": 0.5}
    ppl = {"fp32": 10.0, "hf_accel int8": 10.05, "hf_accel int4": 10.6}
    results = [{"name": v.name, "weight_bytes": 100, "decode_tokens_per_s": 10.0,
                "speed_vs_fp32": speeds.get(v.name, 1.0), "perplexity": ppl.get(v.name, 10.0)}
               for v in script.VARIANTS]
    return {"results": results, "int8_vs_bnb_int8": 3.2}


def test_targets_compare_against_the_issue_thresholds(script):
    rows = script.target_rows(_report(script))
    assert [row[1:] for row in rows] == [["1.60x", "yes"], ["3.20x", "yes"], ["+0.50%", "yes"], ["+6.00%", "**no**"]]


def test_paired_ratio_is_the_median_of_per_repeat_ratios(script):
    assert script.paired_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 1.0]) == 4.0


def test_marked_section_is_replaced(script, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("head\n<!-- bench_weight_quant:start -->\nold\n<!-- bench_weight_quant:end -->\ntail\n")
    script.update_marked_section(doc, "new")
    assert doc.read_text() == "head\n<!-- bench_weight_quant:start -->\nnew\n<!-- bench_weight_quant:end -->\ntail\n"
    assert "| fp32 |" in script.results_table(_report(script))
