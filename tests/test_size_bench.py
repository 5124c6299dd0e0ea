"""benchmarks/bench_size.py: the weight bytes a decode reads per token, the targets from a report, and a --quick run
end to end without llama.cpp (its rows skipped with a message; JSON, markdown and plot written)."""

import json

import pytest
import torch
from tiny_llama import tiny_llama

from hf_accel import WeightOnlyConfig, quantize_model


@pytest.fixture
def script(load_benchmark, monkeypatch, tmp_path):
    module = load_benchmark("bench_size")
    monkeypatch.setattr(module.llama_cpp_peer, "HOME", tmp_path / "no-llama-cpp")  # as on a machine without it
    return module


def test_bytes_per_token_count_the_kernels_layouts_and_leave_the_embedding_out(script):
    model = tiny_llama()
    embedding = model.get_input_embeddings().weight.nbytes
    linears = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert script.bytes_read_per_token(model) >= linears
    assert script.bytes_read_per_token(model) < sum(p.nbytes for p in model.parameters()) - embedding + 1
    int4 = quantize_model(model, WeightOnlyConfig(bits=4, group_size=32), progress=False)
    int4_bytes = script.bytes_read_per_token(int4)
    assert int4_bytes < script.bytes_read_per_token(model) / 2  # codes a byte per two weights, fp16 group params


def test_targets_read_the_largest_models_compiled_rows(script):
    rows = [{"format": fmt, "tool": "hf_accel compiled", "threads": 1, "vs_llama_cpp": ratio,
             "bandwidth_share": share} for fmt, ratio, share in (("int8", 1.5, 0.9), ("int4", 1.1, 0.7))]
    report = {"sizes": [{"rows": []}, {"rows": rows}]}
    targets = {t["name"]: (t["value"], t["met"]) for t in script.targets(report)}
    assert targets == {"int8_vs_llama_cpp (1 thread)": (1.5, True), "int4_vs_llama_cpp (1 thread)": (1.1, False),
                       "int8_bandwidth_share (1 thread)": (0.9, True)}


def test_the_limit_is_the_faster_of_the_probe_and_the_large_fp32_decodes(script):
    """An fp32 decode of a model past the probe's 1 GiB reads only weights: a rate the memory sustains."""
    gib = 2**30
    rows = [{"format": "fp32", "tool": "llama.cpp", "threads": 2, "tokens_per_s": 20.0, "bytes_per_token": 3 * gib},
            {"format": "fp32", "tool": "hf_accel compiled", "threads": 1, "tokens_per_s": 10.0,
             "bytes_per_token": 3 * gib},
            {"format": "fp32", "tool": "llama.cpp", "threads": 1, "tokens_per_s": 1e4, "bytes_per_token": gib // 8},
            {"format": "int8", "tool": "llama.cpp", "threads": 2, "tokens_per_s": 99.0, "bytes_per_token": gib}]
    found = script.read_bandwidth.limits({1: 40e9, 2: 45e9}, [{"rows": rows}])
    assert found == {1: 40e9, 2: 60 * gib}  # the small model's (cached) and the int8 rows never count


def test_quick_run_without_llama_cpp_writes_json_markdown_and_plot(script, tmp_path):
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_size.json").read_text())
    assert report["llama_cpp"] is None and "llama.cpp rows skipped" in report["llama_cpp_skipped"]
    rows = report["sizes"][0]["rows"]
    assert {(r["format"], r["tool"]) for r in rows} == {(fmt, f"hf_accel {mode}") for fmt in script.FORMATS
                                                         for mode in script.MODES}
    assert all(r["tokens_per_s"] > 0 and r["vs_llama_cpp"] is None for r in rows)
    text = (tmp_path / "docs/bench_size.md").read_text()
    assert "| int4 | hf_accel compiled | 1 |" in text and "--quick" in text
    assert (tmp_path / "docs/bench_size.png").stat().st_size > 0
