"""`hf-accel bench` and the benchmark script run end to end (small settings, a few seconds each; notebooks:
test_notebooks.py)."""

import json
from pathlib import Path

import pytest
import torch

import hf_accel
from hf_accel import PagedCache, bench, cli, reference

ROOT = Path(__file__).resolve().parents[1]
QUICK_ROWS = ["DynamicCache", "StaticCache + compile", "hf_accel paged + compile", "hf_accel n-gram", "hf_accel Engine"]
FULL_ROWS = ["DynamicCache", "StaticCache + compile", "hf_accel paged + compile", "hf_accel int4 KV + compile",
             "hf_accel EAGLE + compile", "hf_accel n-gram", "hf_accel Engine", "hf_accel int8 weights",
             "hf_accel int4 weights"]
LOSSY = {"hf_accel int4 KV + compile", "hf_accel int8 weights", "hf_accel int4 weights"}
SMALL_BENCH = ["bench", "--new-tokens", "8", "--prompt-len", "24", "--batch-size", "2", "--repeats", "1"]
DRAFT = str(reference.ASSETS_DIR / "draft")


@pytest.fixture
def one_thread():
    """Timed code on a shared 2-core machine: one torch thread, restored afterwards."""
    with bench.torch_threads(1):
        yield


def _table_rows(text: str, names: list[str]) -> list[str]:
    return [line for line in text.splitlines() if line.split("  ")[0] in names]


def test_bench_quick_prints_one_row_and_one_verdict_per_kind(capsys):
    threads = torch.get_num_threads()
    assert cli.main([*SMALL_BENCH, "--quick"]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out, QUICK_ROWS)
    assert [row.split("  ")[0] for row in rows] == QUICK_ROWS
    assert rows[0].split()[2] == "1.00x"  # the baseline's ratio to itself
    assert all(row.rstrip().endswith("100.0%") for row in rows)  # every quick row is lossless: DynamicCache's tokens
    verdicts = [line[2:] for line in out.splitlines() if line.startswith("- ")]
    assert [line.split(":")[0] for line in verdicts] == QUICK_ROWS
    assert verdicts[0] == "DynamicCache: the baseline, transformers' default"
    assert all("same greedy tokens" in line for line in verdicts[1:])
    assert all("x StaticCache + compile" in line or "as fast as StaticCache + compile" in line
               for line in verdicts[2:])  # each hf_accel row against the fastest stock option too
    assert "--quick: the int4 KV, EAGLE and weight rows are left out" in out
    assert torch.get_num_threads() == threads  # --threads does not leak out of the command


def test_bench_runs_every_feature_on_the_reference_target(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    cli.main([*SMALL_BENCH, "--batch-size", "1", "--draft", DRAFT, "--json", str(path)])
    report = json.loads(path.read_text())
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == [*FULL_ROWS, "hf_accel draft", "transformers assisted (draft)"]
    assert report["settings"]["prompt_lengths"] == [24] and report["settings"]["new_tokens"] == 8
    assert all(r["decode_tokens_per_s"] > 0 for r in results.values())
    for name in ("hf_accel paged + compile", "hf_accel int4 KV + compile"):
        assert results[name]["kv_bytes"] > 0  # measured by an eager run of the same cache
    assert results["hf_accel int4 KV + compile"]["kv_ratio"] < results["hf_accel paged + compile"]["kv_ratio"]
    assert results["hf_accel Engine"]["kv_bytes"] is None  # its pool is sized by EngineConfig, not by the run
    assert report["model"].startswith("hf_accel reference target") and report["prompts"].startswith("held-out")
    lossless = [r for name, r in results.items() if name not in LOSSY]
    assert all(r["agreement"] == 1.0 for r in lossless)  # compiled and speculative rows: DynamicCache's tokens
    assert results["hf_accel int8 weights"]["agreement"] > 0.5
    assert len(report["verdicts"]) == len(results)
    assert "K/V in 4 bits" in next(v for v in report["verdicts"] if v.startswith("hf_accel int4 KV + compile"))
    assert "transformers assisted (draft)" in capsys.readouterr().out


def test_bench_leaves_stock_assisted_out_of_batches(capsys):
    cli.main([*SMALL_BENCH, "--quick", "--draft", DRAFT])
    out = capsys.readouterr().out
    assert "transformers assisted (draft)" not in out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert rows["hf_accel draft"].rstrip().endswith("100.0%")  # a left-padded batch: the same greedy tokens
    assert rows["hf_accel Engine"].rstrip().endswith("100.0%")


def test_train_reference_is_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["train-reference", "--help"])
    assert exited.value.code == 0 and "--which" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bench", "--no-such-option"])


def test_bench_rejects_too_few_new_tokens(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--new-tokens", "1"])
    assert "--new-tokens" in capsys.readouterr().err


def test_prompt_lengths_spread_from_half_to_full():
    assert bench.prompt_lengths(512, 1) == [512]
    assert bench.prompt_lengths(512, 4) == [256, 341, 426, 512]


def test_make_prompts_left_pads():
    inputs = bench.make_prompts([2, 4], vocab_size=50, pad_token_id=0)
    assert inputs["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert inputs["input_ids"][0, :2].tolist() == [0, 0] and bool((inputs["input_ids"][1] > 0).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_bench_weight_rows_keep_float_the_layers_the_packing_does_not_divide(bits):
    model = bench.random_llama(hidden_size=64, num_layers=1, vocab_size=128)  # intermediate 170: not a multiple of 4
    mlp = bench.weight_quantized(bits)(model).model.layers[0].mlp
    assert type(mlp.down_proj) is torch.nn.Linear
    assert isinstance(mlp.up_proj, (hf_accel.Int8Linear, hf_accel.Int4Linear)) and mlp.up_proj.bits == bits
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # the variant is a copy


def test_block_waste_counts_partial_last_blocks_and_shared_blocks_once(one_thread):
    model = bench.random_llama(hidden_size=64, num_layers=2, vocab_size=128)
    cache = PagedCache(model.config, block_size=4)
    prompt = torch.randint(1, 128, (1, 10)).repeat(3, 1)  # 3 identical rows: 2 shared full blocks + 1 partial each
    with torch.inference_mode():
        model(prompt, past_key_values=cache)
    assert cache.pool.num_used_blocks == 2 + 3
    assert bench.block_waste(cache) == pytest.approx(1 - (8 + 3 * 2) / (5 * 4))
    assert bench.kv_bytes(cache) == cache.memory_bytes()


def test_bench_paged_quick_writes_json_and_markdown(tmp_path, capsys, load_benchmark):
    script = load_benchmark("bench_paged")
    script.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmarks/results/bench_paged.json").read_text())
    assert [s["name"] for s in report["speed"]] == [s.name for s in script.QUICK.speed]
    assert 0 <= report["waste"]["block_waste"] < 1
    text = (tmp_path / "docs/bench_paged.md").read_text()
    assert "| hf_accel paged |" in text and script.COMMAND in text
