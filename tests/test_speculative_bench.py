"""benchmarks/bench_speculative.py runs end to end in its quick plan and writes its JSON, its markdown and the tables
docs/speculative.md quotes: every workload and batch size, the model-free rows, transformers' prompt lookup at batch
1 only, identical greedy tokens, the target rows."""

import json

import pytest

from hf_accel import reference


@pytest.mark.skipif(not reference.has_assets(), reason="reference models not built")
def test_quick_run_writes_json_markdown_and_target_rows(tmp_path, load_benchmark):
    script = load_benchmark("bench_speculative")
    (tmp_path / "docs").mkdir()
    markers = "<!-- bench_speculative:start -->\nold\n<!-- bench_speculative:end -->\n"
    (tmp_path / "docs/speculative.md").write_text("x\n" + markers)
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_speculative.json").read_text())
    cases = {(m["workload"], m["mode"], m["batch_size"]): m for m in report["measurements"]}
    assert set(cases) == {(w, mode, b) for w, mode in script.CASES for b in (1, 4)}
    for (workload, mode, batch), m in cases.items():
        names = [r["name"] for r in m["rows"]]
        assert names[0] == "plain generate" and {"hf_accel ngram", "hf_accel ngram + suffix cache"} <= set(names)
        assert ("transformers prompt lookup" in names) == (batch == 1)
        assert ("hf_accel draft" in names) == (workload == "open")
        assert ("hf_accel eagle" in names) == ("hf_accel eagle tree" in names) == (workload == "open")
        if mode == "greedy":
            assert all(r["greedy_agreement"] == 1.0 for r in m["rows"]), workload
        ngram = next(r for r in m["rows"] if r["name"] == "hf_accel ngram")
        assert ngram["tokens_per_target_forward"] >= 1.0 and ngram["x_prompt_lookup" if batch == 1 else "x_plain"] > 0
    copy_prompt = cases[("copy-heavy", "greedy", 1)]["prompt_lengths"]
    assert copy_prompt == [script.QUICK.prompt_lengths[1][0] + 1 + script.COPY_PREFIX]
    assert "earlier requests" in report["suffix_cache"]
    goals = {t["target"] for t in report["targets"]}
    assert "hf_accel ngram x plain >= 2.5x (copy-heavy, greedy, batch 1)" in goals
    assert "hf_accel ngram x prompt lookup >= 1.2x (open, greedy, batch 1)" in goals
    assert "hf_accel ngram + suffix cache x plain >= 0.95x (nothing repeats, greedy, batch 4)" in goals
    assert "| hf_accel ngram + suffix cache |" in (tmp_path / "docs/bench_speculative.md").read_text()
    assert "### copy-heavy, greedy, batch 4" in (tmp_path / "docs/speculative.md").read_text()


@pytest.mark.skipif(not reference.has_assets(), reason="reference models not built")
def test_eagle_run_writes_its_own_results(tmp_path, load_benchmark):
    script = load_benchmark("bench_speculative")
    (tmp_path / "docs").mkdir()
    markers = "<!-- bench_speculative_eagle:start -->\nold\n<!-- bench_speculative_eagle:end -->\n"
    (tmp_path / "docs/speculative.md").write_text("x\n" + markers)
    # without the compiled rows: they would compile a dozen graphs of the reference target first (minutes); compiled
    # EAGLE is tested in test_compiled_eagle.py, its rows' settings below
    script.main(["--quick", "--eagle", "--no-compile", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_speculative_eagle.json").read_text())
    assert {(m["workload"], m["mode"], m["batch_size"]) for m in report["measurements"]} == {
        ("open", mode, b) for mode in ("greedy", "sampling") for b in (1, 4)}
    for m in report["measurements"]:
        plain, eagle, tree = m["rows"]
        assert (plain["name"], eagle["name"], tree["name"]) == ("plain generate", "hf_accel eagle",
                                                                "hf_accel eagle tree")
        for row in (eagle, tree):
            assert row["tokens_per_target_forward"] > 1.0 and 0 < row["head_cost_per_step"] < 1
            assert row["analytic_x_plain"] > 0 and len(row["acceptance_by_position"]) >= 1
            if m["mode"] == "greedy":
                assert row["greedy_agreement"] == 1.0
        assert tree["verify_cost"] > 0 and tree["head_passes_per_round"] >= 1
    assert "hf_accel eagle tokens per target forward >= 3.0x (open, greedy, batch 1)" in {
        t["target"] for t in report["targets"]}
    assert "| hf_accel eagle |" in (tmp_path / "docs/speculative.md").read_text()


@pytest.mark.skipif(not reference.has_assets(), reason="reference models not built")
def test_eagle_compiled_rows_have_eos_off(load_benchmark):
    script = load_benchmark("bench_speculative")
    pair = script.load_pair(script.QUICK, eagle_only=True)
    names = {}
    for mode in ("greedy", "sampling"):
        case = script.Case("open", mode, 1, eos_off=True)
        made = [make(pair, case) for make in script.EAGLE_METHODS]
        names[mode] = [m.strategy.name for m in made if m is not None]
        for method in made:
            if method is not None and "compile" in method.strategy.name:
                kwargs = method.strategy.generate_kwargs(pair.target, 64)
                assert kwargs["eos_token_id"] is None and kwargs["do_sample"] == (mode == "sampling")
                assert kwargs["compile_config"].fullgraph
    rows = ["plain generate", "plain + compile", "hf_accel eagle", "hf_accel eagle tree", "hf_accel eagle + compile"]
    assert names == {"greedy": [*rows, "hf_accel eagle tree + compile"], "sampling": rows}  # compiled trees: greedy
