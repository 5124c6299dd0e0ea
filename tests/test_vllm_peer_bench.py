"""benchmarks/bench_vllm_peer.py without vLLM: the requests both sides get, the result maths (tok/s, medians, ratio,
identical counts, targets, the skip row), and the hf_accel side end to end in --quick mode with the peer absent."""

import json

import pytest

from hf_accel import bench, reference
from hf_accel.bench.peer import (
    count_identical, judged, median_rows, rounds_summary, side_order, tokens_per_s, venv_python,
)
from hf_accel.bench.workload import Request, serving_requests


def _run(outputs, seconds, load=1.0):
    return {"outputs": outputs, "seconds": seconds, "load_seconds": load, "versions": {"x": "1"}}


@pytest.fixture(scope="module")
def tokenizer():
    return reference.load("draft")[1]


def test_both_sides_get_the_same_token_ids_in_range_and_deterministic(load_benchmark, tokenizer, tmp_path):
    script = load_benchmark("bench_vllm_peer")
    plan = script.FULL
    work = serving_requests(tokenizer, plan.target_requests, plan.prompt_range, plan.max_tokens_range,
                            plan.max_model_len)
    assert work == serving_requests(tokenizer, plan.target_requests, plan.prompt_range, plan.max_tokens_range,
                                    plan.max_model_len)
    assert work[: plan.random_requests] == serving_requests(tokenizer, plan.random_requests, plan.prompt_range,
                                                            plan.max_tokens_range, plan.max_model_len)
    for req in work:
        assert plan.prompt_range[0] <= len(req.prompt) <= plan.prompt_range[1]
        assert plan.max_tokens_range[0] <= req.max_tokens <= plan.max_tokens_range[1]
        assert len(req.prompt) + req.max_tokens <= plan.max_model_len
        assert all(0 <= token < len(tokenizer) for token in req.prompt)
    case = script.Case("reference target", tmp_path, work)
    jobs = {side: script.job(side, case, plan, sequential=side == "hf_accel") for side in script.SIDES}
    assert jobs["hf_accel"]["requests"] == jobs["vllm"]["requests"] == [[r.prompt, r.max_tokens] for r in work]
    assert jobs["hf_accel"]["max_num_batched_tokens"] == 512 and jobs["vllm"]["max_num_batched_tokens"] is None
    assert {jobs[side]["max_model_len"] for side in jobs} == {512}
    env = script.side_env("vllm")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "PYTHONPATH" not in env and script.side_env("hf_accel")["PYTHONPATH"] == str(script.ROOT)


def test_round_maths():
    assert side_order(("a", "b"), 0) == ["a", "b"] and side_order(("a", "b"), 1) == ["b", "a"]
    assert tokens_per_s(_run([[1, 2, 3], [4]], 0.5)) == 8.0  # generated ids, not asked-for tokens
    assert count_identical([[1], [2, 3], [4]], [[1], [2, 4], [4]]) == 2
    with pytest.raises(ValueError):
        count_identical([[1]], [[1], [2]])
    summary = rounds_summary([_run([[1, 2]], 1.0, 5.0), _run([[1, 2]], 0.25), _run([[1, 2]], 0.5)])
    assert summary["tokens_per_s"] == 4.0 and summary["rounds_tokens_per_s"] == [2.0, 8.0, 4.0]
    assert summary["load_seconds"] == [5.0, 1.0, 1.0] and summary["generated_tokens"] == 2
    assert summary["same_outputs_every_round"]
    assert not rounds_summary([_run([[1]], 1.0), _run([[2]], 1.0)])["same_outputs_every_round"]
    rounds = [[{"rate": 1.0, "ttft_ms": {"median": 10.0}}, {"rate": "inf", "ttft_ms": {"median": 40.0}}],
              [{"rate": 1.0, "ttft_ms": {"median": 30.0}}, {"rate": "inf", "ttft_ms": {"median": 20.0}}],
              [{"rate": 1.0, "ttft_ms": {"median": 20.0}}, {"rate": "inf", "ttft_ms": {"median": 90.0}}]]
    assert median_rows(rounds) == [{"rate": 1.0, "ttft_ms": {"median": 20.0}},
                                   {"rate": "inf", "ttft_ms": {"median": 40.0}}]
    assert judged("a", ">=", 1.0, 1.5)["met"] and not judged("b", "<=", 1.0, 1.5)["met"]
    assert judged("c", "<=", 1.0, None) == {"name": "c", "goal": "<= 1.0", "value": None, "met": None}
    with pytest.raises(ValueError):
        judged("d", "<", 1.0, 0.5)


def test_offline_row_ratio_identical_counts_and_targets(load_benchmark):
    script = load_benchmark("bench_vllm_peer")
    model = bench.random_llama(hidden_size=64, num_layers=2, vocab_size=128)
    case = script.Case("m", None, [Request([1, 2, 3], 2), Request([4, 5], 2)])
    reference_out = [[7, 8], [9, 10]]
    ours = dict(_run([[7, 8], [9, 10]], 1.0), sequential_outputs=reference_out, sequential_seconds=2.0)
    runs = {"hf_accel": [ours, _run([[7, 8], [9, 10]], 0.5)], "vllm": [_run([[7, 8], [9, 11]], 2.0)] * 2}
    row = script.summarize(model, case, runs)
    assert row["hf_accel"]["tokens_per_s"] == 6.0 and row["vllm"]["tokens_per_s"] == 2.0 and row["ratio"] == 3.0
    assert row["sequential_generate_tokens_per_s"] == 2.0
    assert row["identical_hf_accel_vllm"] == 1 and row["hf_accel_vs_sequential"]["identical"] == 2
    assert row["vllm_vs_sequential"]["identical"] == 1
    assert len(row["vllm_vs_sequential"]["first_difference_top2_gaps"]) == 1
    online = {"hf_accel": [_load(1.0, 50, 10), _load(4.0, 80, 12)], "vllm": [_load(1.0, 100, 10), _load(4.0, 40, 6)]}
    found = {t["name"]: t for t in script.targets({"offline": [{"name": "m", **row}], "online": online})}
    assert found["x vLLM generated tok/s, m"]["met"] and found["share of requests identical to vLLM's"]["value"] == 0.5
    assert found["TTFT p50 / vLLM's at 1 req/s"]["value"] == 0.5 and not found["TPOT p50 / vLLM's at 4 req/s"]["met"]
    skipped = script.summarize(model, case, {"hf_accel": runs["hf_accel"], "vllm": []})
    assert skipped["vllm"] is None and skipped["ratio"] is None and "identical_hf_accel_vllm" not in skipped
    found = script.targets({"offline": [{"name": "m", **skipped}], "online": {"hf_accel": online["hf_accel"]}})
    assert [t["met"] for t in found] == [None, None, True, None, None, None, None]


def _load(rate, ttft, tpot):
    return {"rate": rate, "ttft_ms": {"median": ttft}, "tpot_ms": {"median": tpot}}


def test_quick_run_without_the_peer_writes_the_hf_accel_rows(load_benchmark, tokenizer, tmp_path):
    script = load_benchmark("bench_vllm_peer")
    assert venv_python(tmp_path / "absent", "vllm") is None
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/serving.md").write_text("a\n<!-- bench_vllm_peer:start -->\nold\n<!-- bench_vllm_peer:end -->\n")
    script.main(["--quick", "--out", str(tmp_path), "--vllm-venv", str(tmp_path / "absent")])
    report = json.loads((tmp_path / "benchmarks/results/bench_vllm_peer.json").read_text())
    assert "--setup" in report["vllm_skipped"]
    (row,) = report["offline"]
    assert row["vllm"] is None and row["ratio"] is None and row["requests"] == script.QUICK.random_requests
    assert len(row["hf_accel"]["rounds_tokens_per_s"]) == 2 and row["hf_accel"]["tokens_per_s"] > 0
    plan = script.QUICK
    asked = serving_requests(tokenizer, plan.random_requests, plan.prompt_range, plan.max_tokens_range,
                             plan.max_model_len)
    assert row["hf_accel"]["generated_tokens"] == sum(r.max_tokens for r in asked)  # every request got its tokens
    assert row["hf_accel_vs_sequential"]["identical"] == row["requests"] and row["hf_accel"]["same_outputs_every_round"]
    online = report["online"]
    assert online["vllm"] == [] and [r["rate"] for r in online["hf_accel"]] == [8.0, "inf"]
    assert len(online["rounds"]["hf_accel"]) == script.QUICK.rounds
    assert all(r["output_token_throughput"] > 0 for r in online["hf_accel"])
    doc = (tmp_path / "docs/serving.md").read_text()
    assert "old" not in doc and "| random Llama: llama" in doc and "skipped" in doc
    assert (tmp_path / "docs/bench_vllm_peer.png").stat().st_size > 1000
