"""The fine-tune path on a tiny random Llama with the reference tokenizer: LoRA really changes the model, the merge
equals base + adapter, `run_finetune` writes a folder with heads, `hf_accel.json` and a complete report, and that
folder serves through the `openai` client with its weight preset applied."""

import copy
import json

import openai
import pytest
import torch
from engine_helpers import assert_greedy_equal, greedy_reference
from server_helpers import prompt_ids
from transformers import AutoTokenizer, LlamaForCausalLM

from hf_accel import Engine, EngineConfig, Int8Linear, MedusaHeads, SpeculativeConfig
from hf_accel.reference import ASSETS_DIR
from hf_accel.server import create_app, serve_in_thread
from hf_accel.server.command import resolve_serving
from hf_accel.server.served_engine import load_served_model
from hf_accel.serving_config import read_serving_config
from hf_accel.training.finetune import FinetuneConfig, run_finetune
from hf_accel.training.finetune_domain import domain_splits, text_rows
from hf_accel.training.finetune_quality import Side, compare_speed
from hf_accel.training.finetune_report import report_markdown, report_tables
from hf_accel.training.lora import LoraSettings, merge_adapter, train_lora
from finetune_helpers import tiny_model

SEQ_LEN = 48
PROMPT = "Install the package with pip and"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS_DIR / "target", local_files_only=True)


@pytest.fixture(scope="module")
def splits():
    return domain_splits()


@pytest.fixture(scope="module")
def rows(splits, tokenizer):
    return text_rows(splits.train, tokenizer, SEQ_LEN, max_rows=16)


def test_lora_changes_the_model_and_the_merge_equals_base_plus_adapter(tokenizer, rows, tmp_path):
    model = tiny_model(len(tokenizer))
    base = copy.deepcopy(model)
    ids = rows[:2]
    trained = train_lora(model, rows, LoraSettings(rank=4, alpha=8, steps=4, batch_size=4, lr=1e-2), tmp_path,
                         progress=False)
    assert trained.num_trainable_parameters > 0 and len(trained.losses) >= 1
    with torch.no_grad():
        adapted_logits = trained.model(input_ids=ids).logits
        base_logits = base(input_ids=ids).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-3, "training the adapter changed the outputs"
    merged = merge_adapter(trained.model)
    assert type(merged) is LlamaForCausalLM and not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted_logits, atol=1e-4, rtol=1e-4)


def test_lora_settings_reject_bad_values():
    with pytest.raises(ValueError, match="rank"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(dropout=1.0)
    with pytest.raises(ValueError, match="target_modules"):
        LoraSettings(target_modules=())
    with pytest.raises(ValueError, match="quant"):
        FinetuneConfig(quant="int3")
    with pytest.raises(ValueError, match="seq_len"):
        FinetuneConfig(seq_len=20, prompt_len=16)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, tokenizer, splits):
    out = tmp_path_factory.mktemp("finetuned")
    model = tiny_model(len(tokenizer))
    config = FinetuneConfig(seq_len=SEQ_LEN, lora=LoraSettings(rank=4, steps=3, batch_size=4), medusa_steps=3,
                            medusa_batch_size=4, self_distill_rows=4, quant="int8", eval_rows=4, speed_prompts=1,
                            prompt_len=16, new_tokens=12, repeats=1)
    heads = MedusaHeads.for_model(model, num_heads=2)
    report = run_finetune(model, tokenizer, splits, out, config, init_heads=heads, description="tiny",
                          original_rows=text_rows(splits.held_out, tokenizer, SEQ_LEN, 2), progress=False)
    return out, report


def test_run_finetune_writes_a_folder_to_serve(finetuned):
    out, report = finetuned
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "medusa" / "medusa_heads.safetensors").is_file()
    assert read_serving_config(out).quant == "int8" and read_serving_config(out).heads_path(out) == out / "medusa"
    assert MedusaHeads.from_pretrained(out / "medusa").num_heads == 2, "the given heads' shape is kept"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))


def test_report_has_every_stage(finetuned):
    _, report = finetuned
    assert set(report["perplexity"]) == {"base", "finetuned", "quantized"}
    assert all(set(values) == {"domain", "original"} for values in report["perplexity"].values())
    assert report["perplexity"]["base"] != report["perplexity"]["finetuned"]
    sides = [row["side"] for row in report["speed"]]
    assert sides == ["float, plain generate", "float + Medusa", "int8, plain generate", "int8 + Medusa"]
    first, medusa = report["speed"][:2]
    assert first["speed_ratio"] == 1.0 and first["greedy_agreement"] == 1.0
    assert medusa["greedy_agreement"] == 1.0, "Medusa's greedy output equals plain greedy output"
    assert medusa["tokens_per_step"] >= 1.0
    assert {"data", "lora", "medusa", "quantize", "speed", "total"} <= set(report["times_s"])
    assert report["data"]["held_out_distributions"] and report["medusa"]["steps"] == 3
    assert 0.5 < report["top1_agreement_with_float"] <= 1.0
    assert len(report_tables(report)) == 3 and "| stage |" in report_markdown(report)


def test_the_folder_serves_through_openai_with_its_quantization_and_heads(finetuned):
    out, _ = finetuned
    quant, heads_path = resolve_serving(str(out), None, None)
    assert (quant, heads_path) == ("int8", out / "medusa")
    model, tokenizer = load_served_model(str(out), quant, torch.float32)
    assert any(isinstance(module, Int8Linear) for module in model.modules())
    heads = MedusaHeads.from_pretrained(heads_path, dtype=torch.float32)
    engine = Engine(model, tokenizer, config=EngineConfig(max_num_seqs=2, max_model_len=128),
                    speculative=SpeculativeConfig("medusa", model=heads))
    with serve_in_thread(create_app(engine, tokenizer, "finetuned")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="finetuned", prompt=PROMPT, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert engine.stats().spec_decode_num_drafts > 0, "greedy requests speculated with the folder's heads"
    ids = prompt_ids(tokenizer, PROMPT)
    choice = completion.choices[0]
    assert_greedy_equal(model, ids, choice.token_ids, greedy_reference(model, ids, 8))
    assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)


def test_compare_speed_rejects_bad_input():
    with pytest.raises(ValueError, match="prompts"):
        compare_speed([], torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="new_tokens"):
        compare_speed([Side("a", tiny_model(16))], torch.zeros(1, 4, dtype=torch.long), new_tokens=0)
