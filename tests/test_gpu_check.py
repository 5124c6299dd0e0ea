"""benchmarks/gpu_check.py: without CUDA it measures nothing and says so; `--device cpu --quick` runs the same
comparison on the CPU (compiled step against eager; compiled paged generate against DynamicCache and StaticCache +
compile; compiled draft_generate against plain greedy; LoRA adapters in the engine against merged models), finds
every output identical to sequential generate, and writes its tables."""

import json

import pytest
import torch

from hf_accel.kernels.custom_ops import quantized_linear_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_cuda_nothing_is_measured(load_benchmark, capsys):
    assert load_benchmark("gpu_check").main(["--quick"]) is None
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.compiled
def test_cpu_run_compares_default_and_eager_engines(load_benchmark, tmp_path):
    report = load_benchmark("gpu_check").main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--sections",
                                               "engine,generate,speculative,lora"])
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
        "plain", "plain + compile", "draft + compile"}
    lora = result["lora"]  # adapters in the engine: each request its merged adapter's greedy tokens
    assert lora["identical"] == lora["requests"] == 16 and lora["compiled"] and lora["lora_ms"] > 0
    assert "LoRA adapters in the engine, fp32" in (tmp_path / "docs/gpu_check.md").read_text()


@pytest.mark.compiled
@pytest.mark.skipif(quantized_linear_kernels() is None, reason="hf_accel's C++ extension is not built")
def test_cpu_run_of_the_weights_section(load_benchmark, tmp_path):
    """int8 / int4 copies of a random bf16 Llama: their kernels' layouts, logits close to bf16's, eager and compiled
    generate equal, the table written."""
    report = load_benchmark("gpu_check").main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--sections",
                                               "weights"])
    assert report["results"] == {}
    formats = report["weights"]["formats"]
    assert list(formats) == ["bf16", "int8", "int4"] and formats["bf16"]["layouts"] == []
    assert formats["int8"]["layouts"] == formats["int4"]["layouts"] == ["panels"]
    assert formats["int4"]["weight_bytes"] < formats["int8"]["weight_bytes"] < formats["bf16"]["weight_bytes"]
    assert all(f["logits_cosine"] > 0.95 and f["generate"]["identical"] and not f["generate"]["errors"]
               for f in formats.values())
    assert "| int4 | panels |" in (tmp_path / "docs/gpu_check.md").read_text()


def test_an_unknown_section_or_method_is_refused_by_name(load_benchmark, capsys):
    for argv in (["--sections", "engine,graphs"], ["--speculative", "draft,lookahead"]):
        with pytest.raises(SystemExit):
            load_benchmark("gpu_check").main(["--quick", "--device", "cpu", *argv])
        assert "--sections takes" in capsys.readouterr().err


def test_a_report_of_some_sections_renders_only_those(load_benchmark):
    module = load_benchmark("gpu_check")
    side = {"identical": True, "identical_sides": {"plain": True, "ngram + compile": True}, "errors": {},
            "first_call_s": {"plain": 0.1, "ngram + compile": 40.0},
            "ms_per_token": {"plain": 7.9, "ngram + compile": 0.9}}
    text = module.render({"gpu": "GPU", "device": "cuda", "command": "c", "results": {"fp32": {"speculative": side}}})
    assert "| ngram + compile | True | 40.0 | 0.90 | - |" in text
    assert "decode step ms" not in text and "static+compile" not in text
