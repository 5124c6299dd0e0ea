"""benchmarks/bench_lora.py: the request-to-adapter assignments, its adapters are peft folders the engine serves,
the engine and peft sides give the same greedy tokens on a tiny model, and the page renders its rows and targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from tiny_llama import tiny_llama  # noqa: E402

from hf_accel import Engine, EngineConfig, LoRAConfig  # noqa: E402
from hf_accel.bench.workload import Request  # noqa: E402


@pytest.fixture(scope="module")
def script():
    import bench_lora

    return bench_lora


def test_assignments(script):
    assert script.assignments("base", 3) == [None] * 3 and script.assignments("one", 2) == [0, 0]
    assert script.assignments("uniform", 10) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    skewed = script.assignments("skewed", 400)
    assert skewed.count(0) > skewed.count(7) > 0 and skewed == script.assignments("skewed", 400)


def test_engine_and_peft_sides_agree_on_a_tiny_model(script, tmp_path):
    from peft import PeftModel

    model = tiny_llama(seed=5)
    adapters = script.make_adapters(model, tmp_path)
    assert len(adapters) == script.NUM_ADAPTERS and adapters[0].lora_int_id == 1
    work = [Request([5, 6, 7, 8], 6), Request([9, 10], 4), Request([11, 12, 13], 5)]
    chosen = [3, None, 7]
    engine = Engine(model, config=EngineConfig(), lora=LoRAConfig(max_lora_rank=script.RANK))
    _, served = script.engine_run(engine, work, adapters, chosen)
    peft_model = PeftModel.from_pretrained(tiny_llama(seed=5), adapters[0].lora_path, adapter_name="adapter0")
    for request in adapters[1:]:
        peft_model.load_adapter(request.lora_path, adapter_name=request.lora_name)
    _, reference = script.peft_run(peft_model.eval(), work, chosen, batch=2)
    assert [len(tokens) for tokens in served] == [6, 4, 5] and served == reference


def test_targets_and_page(script):
    rows = [{"run": run, "tok_s": tok_s, "vs_base_compiled": ratio, "vs_base_eager": ratio, "identical_to_peft": same}
            for run, tok_s, ratio, same in [("base, compiled", 100.0, 1.0, None),
                                            ("LoRA engine, 8 adapters uniform", 90.0, 0.9, 63),
                                            (script.PEFT_ROW, 10.0, 0.1, None)]]
    steps = [{"batch": 4, "base_ms": 2.0, "lora_base_ms": 2.1, "lora_mixed_ms": 2.5, "mixed_vs_base": 0.8}]
    size_185m = {"rows": [{"run": "base engine, base requests", "tok_s": 50.0, "vs_base_compiled": 1.0},
                          {"run": "LoRA engine, 8 adapters uniform", "tok_s": 40.0, "vs_base_compiled": 0.8}],
                 "vllm": {"skipped": "no vLLM venv"}, "step_times": steps}
    vllm_reference = {"rows": {"base": {"hf_accel_tok_s": 100.0, "vllm_tok_s": 80.0, "hf_accel_vs_vllm": 1.25,
                                        "identical": 64},
                               "uniform": {"hf_accel_tok_s": 90.0, "vllm_tok_s": 60.0, "hf_accel_vs_vllm": 1.5,
                                           "identical": 60}}}
    runtime_load = {"seconds_to_first_token": 0.4, "failed": 0, "requests": 33}
    found = script.targets(rows, vllm_reference, size_185m, runtime_load)
    assert [t["met"] for t in found] == [True, False, True, True, True]  # 185M at 0.8x misses; its vLLM row skipped
    assert found[2]["value"] == pytest.approx(9.0) and found[3]["value"] == 1.5
    report = {"hardware": {"cpu": "a CPU"}, "requests": 64, "tokens": 2000, "adapters": 8, "rank": 16,
              "targets": ["q_proj"], "rows": rows, "targets_met": found, "command": "x", "total_seconds": 60,
              "step_times": steps,
              "vllm_reference": vllm_reference, "size_185m": size_185m, "runtime_load": runtime_load}
    page = script.render(report)
    assert "| LoRA engine, 8 adapters uniform | 90 | 0.90x | 0.90x | 63 of 64 |" in page and "| yes |" in page
    assert "| reference target | 8 adapters uniform | 90 | 60 | 1.50x | 60 of 64 |" in page
    assert "| 185M | skipped: no vLLM venv |" in page and "first token 0.40 s after the call; 0 of 33" in page
    assert page.count("| 4 | 2.00 | 2.10 | 2.50 | 0.80x |") == 2  # the step-time tables of both models


def test_step_times_cover_each_batch_size_and_leave_the_engines_empty(script, tmp_path, monkeypatch):
    import lora_step_times

    monkeypatch.setattr(lora_step_times, "BATCH_SIZES", (1, 3))
    monkeypatch.setattr(lora_step_times, "TIMED_STEPS", 2)
    base, model = tiny_llama(seed=5), tiny_llama(seed=5)
    adapters = script.make_adapters(model, tmp_path)[:2]
    engines = [Engine(base), Engine(model, lora=LoRAConfig(max_lora_rank=script.RANK))]
    work = [Request([5, 6, 7, 8], 6), Request([9, 10], 4)]
    rows = lora_step_times.step_times(*engines, work, adapters, repeats=1)
    assert [row["batch"] for row in rows] == [1, 3]
    assert all(row[key] > 0 for row in rows for key in ("base_ms", "lora_base_ms", "lora_mixed_ms"))
    assert not any(engine.has_unfinished_requests() for engine in engines)
