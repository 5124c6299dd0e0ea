"""`hf-accel finetune --adapter-only`: the folder is a peft adapter (nothing merged, no heads, no quantization) that
the Engine serves unmerged with the greedy output of peft's `merge_and_unload` of the same folder, with a report
of held-out perplexity before and after and a README naming the serve line; options of the merged path are refused
by name."""

import copy
import json

import pytest
import torch
from transformers import AutoTokenizer

from hf_accel import Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams, cli
from hf_accel.lora.adapter_files import read_adapter
from hf_accel.lora.layers import adaptable_projections
from hf_accel.reference import ASSETS_DIR
from hf_accel.training.finetune import FinetuneConfig
from hf_accel.training.finetune_adapter import adapter_serve_command, run_adapter_finetune
from hf_accel.training.finetune_command import options_not_with_adapter_only
from hf_accel.training.finetune_domain import domain_splits, text_rows
from hf_accel.training.finetune_report import report_tables
from hf_accel.training.lora import LoraSettings
from finetune_helpers import tiny_model

peft = pytest.importorskip("peft")

SEQ_LEN = 48
NEW_TOKENS = 12
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "README.md", "report.json"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS_DIR / "target", local_files_only=True)


@pytest.fixture(scope="module")
def splits():
    return domain_splits()


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, tokenizer, splits):
    """(base model untouched, adapter folder, report) of a tiny adapter-only fine-tune."""
    out = tmp_path_factory.mktemp("runs") / "docs"
    model = tiny_model(len(tokenizer))
    base = copy.deepcopy(model)
    config = FinetuneConfig(seq_len=SEQ_LEN, lora=LoraSettings(rank=4, alpha=8, steps=4, batch_size=4, lr=1e-2),
                            eval_rows=4, prompt_len=16)
    report = run_adapter_finetune(model, tokenizer, splits, out, config, description="tiny",
                                  original_rows=text_rows(splits.held_out, tokenizer, SEQ_LEN, 2),
                                  base_model="./tiny-base", progress=False)
    return base, out, report


def test_the_folder_is_a_peft_adapter_and_nothing_else(adapter_run):
    base, out, report = adapter_run
    assert {path.name for path in out.iterdir()} == ADAPTER_FILES
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    projections = {name: (m.in_features, m.out_features) for name, m in adaptable_projections(base).items()}
    weights = read_adapter("docs", out, projections, max_rank=4, dtype=torch.float32)
    assert weights.rank == 4 and len(weights.modules) == 2 * 7, "every attention and MLP projection of 2 layers"
    assert any(b.abs().max() > 0 for _, b in weights.modules.values()), "training moved lora_B off its zero init"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))


def test_report_has_perplexity_before_and_after_and_the_serve_line(adapter_run):
    _, out, report = adapter_run
    assert set(report["perplexity"]) == {"base", "finetuned"}
    assert all(set(values) == {"domain", "original"} for values in report["perplexity"].values())
    assert report["perplexity"]["base"] != report["perplexity"]["finetuned"]
    assert report["settings"]["adapter_only"] and report["settings"]["lora"]["rank"] == 4
    assert {"data", "lora", "evaluate base", "evaluate fine-tuned", "save adapter", "total"} == set(report["times_s"])
    assert "speed" not in report and "medusa" not in report
    assert report["serve"] == f"hf-accel serve --model ./tiny-base --lora-modules docs={out}"
    assert report["serve"] in (out / "README.md").read_text()
    tables = report_tables(report)
    assert len(tables) == 2 and "base + LoRA adapter (unmerged)" in str(tables[0])


def test_the_engine_serves_it_as_peft_merges_it(adapter_run):
    base, out, _ = adapter_run
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(base), out).merge_and_unload().eval()
    prompts = [[5, 9, 17, 33, 2, 71, 8], [40, 41, 42, 43, 44, 45], [300, 12, 900]]

    def greedy(model, prompt):
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0)
        return ids[0, len(prompt):].tolist()

    want = [greedy(merged, prompt) for prompt in prompts]
    assert want != [greedy(base, prompt) for prompt in prompts], "the adapter changes the output: the test can fail"
    engine = Engine(copy.deepcopy(base), config=EngineConfig(max_num_seqs=4), lora=LoRAConfig())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = engine.generate(prompts, params, lora_request=LoRARequest("docs", 1, str(out)))
    assert [output.outputs[0].token_ids for output in outputs] == want


def test_serve_line_names_the_base_and_a_rank_over_serves_default(tmp_path):
    assert adapter_serve_command(tmp_path / "sql", None, 16) == f"hf-accel serve --lora-modules sql={tmp_path}/sql"
    line = adapter_serve_command("runs/a b", "/m/base", 128)
    assert line == "hf-accel serve --model /m/base --lora-modules 'a b=runs/a b' --max-lora-rank 128"


def run_cli(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(["finetune", *argv])
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize("extra, named", [
    (["--quant", "int8"], "--quant"),
    (["--quant", "int4", "--init-heads", "none"], "--quant, --init-heads"),
    (["--medusa-steps", "3"], "--medusa-steps"),
    (["--self-distill-rows", "2", "--repeats", "1"], "--self-distill-rows, --repeats"),
])
def test_options_of_the_merged_path_are_refused_by_name(extra, named, capsys, tmp_path):
    code, err = run_cli(["--adapter-only", "--out", str(tmp_path / "x"), *extra], capsys)
    assert code == 2 and f"{named} cannot be used with --adapter-only" in err


def test_quant_none_and_the_shared_options_are_allowed():
    assert options_not_with_adapter_only(["--adapter-only", "--out", "x", "--quant", "none", "--lora-steps", "2",
                                          "--eval-rows", "2", "--seq-len", "48"]) == []
    assert options_not_with_adapter_only(["--out", "x", "--new-tokens", "4"]) == ["--new-tokens"]


def test_an_out_folder_holding_an_adapter_is_refused(tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text("{}")
    code, err = run_cli(["--adapter-only", "--out", str(tmp_path)], capsys)
    assert code == 2 and "already holds a model (adapter_config.json)" in err


def test_the_command_writes_an_adapter_of_the_reference_target(tmp_path, capsys):
    out = tmp_path / "ref-docs"
    assert cli.main(["finetune", "--adapter-only", "--out", str(out), "--lora-steps", "2", "--batch-size", "2",
                     "--lora-rank", "2", "--seq-len", "48", "--eval-rows", "2", "--quant", "none",
                     "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"serve it with: hf-accel serve --lora-modules ref-docs={out}" in printed
    assert "base + LoRA adapter (unmerged)" in printed
    from hf_accel import reference

    target, _ = reference.load("target")
    projections = {name: (m.in_features, m.out_features) for name, m in adaptable_projections(target).items()}
    assert read_adapter("ref-docs", out, projections, max_rank=2, dtype=torch.float32).rank == 2
    assert {path.name for path in out.iterdir()} == ADAPTER_FILES
