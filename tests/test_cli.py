"""`hf-accel bench`, the benchmark script and the notebook run end to end (small settings, a few seconds each)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_accel import PagedCache, bench, cli

ROOT = Path(__file__).resolve().parents[1]
STRATEGY_NAMES = [s.name for s in bench.STRATEGIES]
SMALL_BENCH = ["bench", "--new-tokens", "8", "--prompt-len", "24", "--batch-size", "2", "--repeats", "1"]


@pytest.fixture
def one_thread():
    """Timed code on a shared 2-core machine: one torch thread, restored afterwards."""
    with bench.torch_threads(1):
        yield


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.split("  ")[0] in STRATEGY_NAMES]


def test_bench_prints_one_row_per_strategy(capsys):
    threads = torch.get_num_threads()
    assert cli.main(SMALL_BENCH) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert [row.split("  ")[0] for row in rows] == STRATEGY_NAMES
    assert rows[0].split()[2] == "1.00x"  # the baseline's ratio to itself
    assert all(row.rstrip().endswith("100.0%") for row in rows)  # greedy tokens agree with DynamicCache
    assert torch.get_num_threads() == threads  # --threads does not leak out of the command


def test_bench_json_is_valid(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    cli.main([*SMALL_BENCH, "--batch-size", "1", "--json", str(path)])
    report = json.loads(path.read_text())
    assert [r["name"] for r in report["results"]] == STRATEGY_NAMES
    assert report["settings"]["prompt_lengths"] == [24] and report["settings"]["new_tokens"] == 8
    assert all(r["decode_tokens_per_s"] > 0 and r["kv_bytes"] > 0 for r in report["results"])
    assert "random-weight" in report["model"]


def test_bench_rejects_too_few_new_tokens(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--new-tokens", "1"])
    assert "--new-tokens" in capsys.readouterr().err


def test_prompt_lengths_spread_from_half_to_full():
    assert cli.prompt_lengths(512, 1) == [512]
    assert cli.prompt_lengths(512, 4) == [256, 341, 426, 512]


def test_make_prompts_left_pads():
    inputs = bench.make_prompts([2, 4], vocab_size=50, pad_token_id=0)
    assert inputs["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert inputs["input_ids"][0, :2].tolist() == [0, 0] and bool((inputs["input_ids"][1] > 0).all())


def test_block_waste_counts_partial_last_blocks_and_shared_blocks_once(one_thread):
    model = bench.random_llama(hidden_size=64, num_layers=2, vocab_size=128)
    cache = PagedCache(model.config, block_size=4)
    prompt = torch.randint(1, 128, (1, 10)).repeat(3, 1)  # 3 identical rows: 2 shared full blocks + 1 partial each
    with torch.inference_mode():
        model(prompt, past_key_values=cache)
    assert cache.pool.num_used_blocks == 2 + 3
    assert bench.block_waste(cache) == pytest.approx(1 - (8 + 3 * 2) / (5 * 4))
    assert bench.kv_bytes(cache) == cache.memory_bytes()


def test_bench_paged_quick_writes_json_and_markdown(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_paged", ROOT / "benchmarks" / "bench_paged.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # dataclasses look their module up while being defined
    spec.loader.exec_module(script)
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_paged.json").read_text())
    assert [s["name"] for s in report["speed"]] == [s.name for s in script.QUICK.speed]
    assert 0 <= report["waste"]["block_waste"] < 1
    text = (tmp_path / "docs/bench_paged.md").read_text()
    assert "| hf_accel paged |" in text and script.COMMAND in text


def test_notebook_code_cells_run_in_order(one_thread):
    notebook = json.loads((ROOT / "notebooks" / "paged_cache.ipynb").read_text())
    assert notebook["nbformat"] == 4
    namespace: dict = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "paged_cache.ipynb", "exec"), namespace)
    assert isinstance(namespace["cache"], PagedCache)
