"""`hf-accel serve --speculative-config JSON` (vLLM's flag): parsed into the engine's `SpeculativeConfig`, bad JSON or
fields refused with the reason, and the `spec_decode_*` counters (per position too) exposed on /metrics."""

import json

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine_helpers import greedy_reference
from hf_accel import EagleHead, MedusaHeads, SamplingParams, SpeculativeConfig
from hf_accel.server import command
from hf_accel.server.speculative_option import parse_speculative_config
from server_helpers import MODEL_NAME, live_server, load_target, prompt_ids, served_app

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"


def test_parse_the_flag():
    config = parse_speculative_config('{"method": "suffix", "num_speculative_tokens": 5}', torch.float32)
    assert config == SpeculativeConfig("suffix", num_speculative_tokens=5)
    config = parse_speculative_config('{"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
                                      torch.float32)
    assert (config.method, config.lookup_max, config.lookup_min) == ("ngram", 4, 2)


@pytest.mark.parametrize("text, message", [
    ("{method: suffix}", "must be a JSON object"),
    ('["suffix"]', "must be a JSON object"),
    ('{"num_speculative_tokens": 5}', "needs a `method`"),
    ('{"method": "suffix", "speculative_model": "x"}', "unknown keys \\['speculative_model'\\]; allowed: method"),
    ('{"method": "eagle"}', "'ngram', 'suffix', 'medusa', 'eagle3'"),
    ('{"method": "eagle3"}', "needs `model`, the path of a saved EAGLE head's folder"),
    ('{"method": "draft"}', "needs `model`, the path of a saved draft model's folder"),
    ('{"method": "draft", "model": "/no/such/model"}', "no draft model in '/no/such/model'"),
    ('{"method": "eagle3", "model": "/no/such/head"}', "no EAGLE head in '/no/such/head'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "model": "path"}', "`model` must be None"),
    ('{"method": "medusa"}', "needs `model`, the path of a MedusaHeads folder"),
    ('{"method": "medusa", "model": "/no/such/heads"}', "cannot load Medusa heads"),
])
def test_bad_flags_are_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text, torch.float32)


def test_medusa_heads_folder_through_the_flag(tmp_path):
    model, _ = load_target()
    MedusaHeads.for_model(model, num_heads=2).save_pretrained(tmp_path)
    config = parse_speculative_config(json.dumps({"method": "medusa", "model": str(tmp_path)}), torch.float32)
    assert isinstance(config.model, MedusaHeads) and config.num_candidates == 2


def test_eagle_head_folder_through_the_flag(tmp_path, monkeypatch):
    model, _ = load_target()
    EagleHead.for_model(model).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="`prompt_lookup_max` is for the methods 'ngram', 'suffix', not 'eagle3'"):
        parse_speculative_config(json.dumps({"method": "eagle3", "model": str(tmp_path), "prompt_lookup_max": 2}),
                                 torch.float32)
    flag = json.dumps({"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3})
    with served_app(monkeypatch, ["--enforce-eager", "--no-engine-process", "--speculative-config", flag]) as app:
        speculative = app.state.server.engine.speculative  # the head, loaded for the served model
    assert speculative.method == "eagle3" and isinstance(speculative.model, EagleHead)
    assert speculative.num_candidates == 3


def test_draft_model_folder_through_the_flag(tmp_path, monkeypatch):
    from hf_accel import reference

    draft, _ = reference.load("draft")
    draft.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="`prompt_lookup_max` is for the methods 'ngram', 'suffix', not 'draft'"):
        parse_speculative_config(json.dumps({"method": "draft", "model": str(tmp_path), "prompt_lookup_max": 2}),
                                 torch.float32)
    flag = json.dumps({"method": "draft", "model": str(tmp_path), "num_speculative_tokens": 2})
    prompt = [5, 6, 7, 8]
    with served_app(monkeypatch, ["--enforce-eager", "--no-engine-process", "--speculative-config", flag]) as app:
        engine = app.state.server.engine
        assert engine.speculative.method == "draft" and engine.speculative.num_candidates == 2
        assert type(engine.speculative.model).__name__ == type(draft).__name__
        out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    target = engine.core.model
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out.token_ids == expected[0, 4:].tolist()


def test_serve_exits_with_the_reason(capsys):
    with pytest.raises(SystemExit):
        command.main(["--speculative-config", '{"method": "suffix", "num_speculative_tokens": -1}'])
    assert "--speculative-config: `num_speculative_tokens` must be a positive int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        command.main(["--speculative-config", '{"method": "suffix"}', "--num-speculative-tokens", "2"])
    assert "replaces --medusa-heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        command.main(["--max-speculative-batch-tokens", "8"])
    assert "need --medusa-heads" in capsys.readouterr().err


def test_serve_builds_the_engine_with_the_flag(monkeypatch):
    with served_app(monkeypatch, ["--enforce-eager", "--no-engine-process", "--speculative-config",
                                  '{"method": "suffix", "num_speculative_tokens": 6}']) as app:
        assert app.state.server.engine.speculative == SpeculativeConfig("suffix", num_speculative_tokens=6)


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """/metrics as {family: {labels without model_name: value}}."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {f.name: {tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
                     for s in f.samples if s.name.endswith("_total")} for f in families}


def test_spec_decode_metrics_count_the_suffix_speculation():
    model, tokenizer = load_target()
    prompt = CODE * 3
    # before the server: while its engine's loop is busy the model's attention is the engine's
    expected = tokenizer.decode(greedy_reference(model, prompt_ids(tokenizer, prompt), 32), skip_special_tokens=True)
    with live_server(model, tokenizer, speculative=SpeculativeConfig("suffix")) as live:
        client = openai.OpenAI(base_url=live.api_url, api_key="unused", max_retries=0, timeout=120)
        text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=32, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert text == expected
        metrics = scrape(live.url)
    drafts = metrics["hf_accel:spec_decode_num_drafts"][()]
    proposed = metrics["hf_accel:spec_decode_num_draft_tokens"][()]
    accepted = metrics["hf_accel:spec_decode_num_accepted_tokens"][()]
    per_position = metrics["hf_accel:spec_decode_num_accepted_tokens_per_pos"]
    assert 0 < accepted <= proposed and drafts > 0
    assert sum(per_position.values()) == accepted and per_position[(("position", "0"),)] > 0
    first = [per_position.get((("position", str(j)),), 0) for j in range(len(per_position))]
    assert first == sorted(first, reverse=True)  # candidate j is accepted only after 0..j-1 were
