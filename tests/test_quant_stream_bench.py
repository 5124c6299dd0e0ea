"""benchmarks/bench_quant_stream.py: a sweep calls every quantized Linear of a model and counts the bytes its kernels
read; a --quick run end to end (JSON and markdown written)."""

import json

import pytest
import torch
from tiny_llama import tiny_llama

from hf_accel import Int4Linear, WeightOnlyConfig, quantize_model


def test_a_sweep_reads_every_quantized_linear_once(load_benchmark):
    script = load_benchmark("bench_quant_stream")
    model = quantize_model(tiny_llama(), WeightOnlyConfig(bits=4))
    run, nbytes = script.sweep(model)
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert linears and nbytes == sum(m.weight.nbytes + m.weight_qpanels.nbytes for m in linears)
    run()  # the kernels accept every Linear's row and tensors


def test_a_model_without_quantized_linears_is_refused(load_benchmark):
    script = load_benchmark("bench_quant_stream")
    with pytest.raises(RuntimeError, match="no quantized Linear"):
        script.sweep(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_quick_run_writes_json_and_markdown(load_benchmark, tmp_path):
    script = load_benchmark("bench_quant_stream")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_quant_stream.json").read_text())
    assert {(row["format"], row["threads"]) for row in report["rows"]} == {("int8", 1), ("int4", 1)}
    assert all(row["read_gb_s"] > 0 and row["probe_gb_s"] > 0 and row["share"] > 0 for row in report["rows"])
    text = (tmp_path / "docs/bench_quant_stream.md").read_text()
    assert "| int4 | 1 |" in text and "--quick" in text
