"""benchmarks/bench_engine_step.py runs end to end on a tiny model (a smoke run): every stage is claimed once (no
stage negative, the stages add up to the step), the engine's outputs are unchanged by the timing wrappers, and the
docs table is written."""

import json

from hf_accel import Engine, SamplingParams, bench
from hf_accel.kernels.custom_ops import paged_attention_kernel


def test_bench_engine_step_quick_adds_up_and_writes_the_docs_table(tmp_path, load_benchmark):
    script = load_benchmark("bench_engine_step")
    (tmp_path / "docs").mkdir()
    markers = "<!-- bench_engine_step:start -->\nold\n<!-- bench_engine_step:end -->"
    (tmp_path / "docs/serving.md").write_text(f"a\n{markers}\n")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_engine_step.json").read_text())
    assert [r["sequences"] for r in report["results"]] == [1, 4]
    for result in report["results"]:
        stages = result["stage_ms"]
        assert set(stages) == set(script.STAGES) and all(ms >= 0 for ms in stages.values()), stages
        assert abs(sum(stages.values()) - result["step_ms"]) <= 0.05 * result["step_ms"]
        assert stages["forward"] > 0 and stages["K/V write + attention"] > 0
        assert (stages["gather"] > 0) == (paged_attention_kernel() is None)  # attention reads the pool in place
    doc = (tmp_path / "docs/serving.md").read_text()
    assert "old" not in doc and "| **step** |" in doc


def test_instrumented_engine_gives_the_same_tokens(load_benchmark):
    script = load_benchmark("bench_engine_step")
    model = bench.random_llama(hidden_size=64, num_layers=2, vocab_size=512)
    prompts = bench.make_prompts([12, 12], 512)["input_ids"].tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = [out.token_ids for out in Engine(model).generate(prompts, params)]
    engine = Engine(model)
    with script.instrumented(engine, script.StageClock()):
        timed = [out.token_ids for out in engine.generate(prompts, params)]
    assert timed == plain
