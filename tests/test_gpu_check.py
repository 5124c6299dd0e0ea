"""benchmarks/gpu_check.py: without CUDA it measures nothing and says so; `--device cpu --quick` runs the same
comparison on the CPU (compiled step against eager; compiled paged generate against DynamicCache and StaticCache +
compile; compiled draft_generate against plain greedy), finds every output identical to sequential generate, and
writes its tables."""

import json

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_cuda_nothing_is_measured(load_benchmark, capsys):
    assert load_benchmark("gpu_check").main(["--quick"]) is None
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.compiled
def test_cpu_run_compares_default_and_eager_engines(load_benchmark, tmp_path):
    report = load_benchmark("gpu_check").main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    result = report["results"]["fp32"]
    assert result["compiled"] and not result["graphs"]
    assert result["identical"] == result["requests"] == 4
    assert set(result["steps"]) == {"1", "4"} and all(s["default_ms"] > 0 for s in result["steps"].values())
    assert json.loads((tmp_path / "benchmarks/results/gpu_check.json").read_text())["device"] == "cpu"
    assert "| fp32 | False | 4/4 |" in (tmp_path / "docs/gpu_check.md").read_text()
    generate = result["generate"]
    assert set(generate) == {"2"} and all(g["identical"] for g in generate.values())
    assert all(ms > 0 for g in generate.values() for ms in g["ms_per_token"].values())
    speculative = result["speculative"]
    assert speculative["identical"] and not speculative["errors"] and set(speculative["ms_per_token"]) == {
        "plain", "draft + compile"}
