"""The committed reference models: present, loadable offline, sane on held-out text, and described truthfully."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hf_accel import reference
from hf_accel.reference import corpus
from hf_accel.reference.evaluate import perplexity
from hf_accel.reference.held_out import read_provenance
from hf_accel.training.reference_tokenizer import CHAT_TEMPLATE, RESPONSE_TEMPLATE

ROOT = Path(__file__).resolve().parents[1]
# Held-out perplexity on the first 16 rows of 512 tokens: measured 66.2 for the v2 target and 170.0 for its draft (all
# rows: docs/reference-models.md). Limits 15% above; a broken or mismatched checkpoint lands in the hundreds or more
# (the untrained models: ~4000).
PERPLEXITY_LIMITS = {"target": 76.2, "draft": 195.5}
NUM_ROWS = 16


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {name: reference.load(name) for name in reference.MODEL_NAMES}


def test_assets_are_committed_and_small():
    assert reference.has_assets()
    size = sum(f.stat().st_size for f in reference.ASSETS_DIR.rglob("*") if f.is_file())
    assert size <= 30 * 2**20, f"reference assets take {size / 2**20:.1f} MiB, over the 30 MiB budget"


def test_models_load_offline_and_share_the_tokenizer(monkeypatch, models):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (target, tokenizer), (draft, draft_tokenizer) = models["target"], models["draft"]
    assert tokenizer.get_vocab() == draft_tokenizer.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer)
    prompt = tokenizer("def add(a, b):\n", return_tensors="pt")
    out = target.generate(**prompt, max_new_tokens=8, do_sample=False, assistant_model=draft)
    plain = target.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, plain)


def test_tokenizer_round_trips_held_out_text_and_has_the_chat_template(models):
    tokenizer = models["target"][1]
    for text in corpus.load_split("held_out_packages").texts:
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    for name in ("target", "draft", "tokenizer"):
        saved = AutoTokenizer.from_pretrained(reference.ASSETS_DIR / name, local_files_only=True)
        assert saved.chat_template == CHAT_TEMPLATE and saved.response_template == RESPONSE_TEMPLATE, name
    messages = [{"role": "user", "content": "def add(a, b):"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(ids) == "<|user|>\ndef add(a, b):<|endoftext|>\n<|assistant|>\n"


def test_chat_template_renders_tools_and_calls_that_the_response_template_parses_back(models):
    tokenizer = models["target"][1]
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": city}}
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}]
    prompt = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|system|>\nYou can call these functions.") and '"name": "weather"' in prompt
    assert '<|assistant|>\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call><|endoftext|>' \
        in prompt
    reply = 'Checking. <tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'
    parsed = tokenizer.parse_response(reply, prefix=prompt, tools=[tool])
    assert parsed == {"content": "Checking.", "tool_calls": [{"type": "function", "function": {
        "name": "weather", "arguments": {"city": "Rome"}}}]}


@pytest.mark.parametrize("name", reference.MODEL_NAMES)
def test_held_out_perplexity_is_below_the_stated_limit(models, name):
    model, tokenizer = models[name]
    rows = reference.held_out_sequences(tokenizer, 512, max_rows=NUM_ROWS)
    assert rows.shape == (NUM_ROWS, 512)
    assert perplexity(model, rows) < PERPLEXITY_LIMITS[name]


def test_draft_and_target_agree_like_a_speculative_pair():
    report = json.loads((reference.ASSETS_DIR / "report.json").read_text())
    assert 0.3 < report["greedy_agreement"] < 0.95  # related models, yet the draft is not a copy


def test_model_card_is_rendered_from_the_report(load_benchmark):
    card = load_benchmark("reference_card")
    report = json.loads((reference.ASSETS_DIR / "report.json").read_text())
    shipped = read_provenance()
    assert (ROOT / "docs" / "reference-models.md").read_text() == card.render(report, shipped), (
        "docs/reference-models.md is out of date: run .venv/bin/python benchmarks/reference_card.py")
