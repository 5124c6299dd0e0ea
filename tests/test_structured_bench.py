"""benchmarks/bench_structured.py: its schemas' example records validate and make the few-shot prompts, an output
is judged valid / invalid / cut, the targets read a report, the page renders with and without vLLM's row, and the
mask clock restores what it wraps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("xgrammar")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from structured_schemas import SCHEMAS, extraction_prompt  # noqa: E402


@pytest.fixture(scope="module")
def script():
    import bench_structured

    return bench_structured


def test_examples_fit_their_schemas_and_open_their_prompts():
    for name, entry in SCHEMAS.items():
        jsonschema.validate(entry["example"], entry["schema"])
        prompt = extraction_prompt(name, 2)
        assert prompt.endswith("record = ") and json.dumps(entry["example"]) in prompt and "batch 2" in prompt


def test_outputs_are_judged_valid_invalid_or_cut(script):
    example = json.dumps(SCHEMAS["book"]["example"])
    assert script.check("book", example, "stop") == "valid"
    assert script.check("book", example.replace("1965", "99"), "stop") == "invalid"  # below the minimum year
    assert script.check("book", "{not json", "stop") == "invalid"
    assert script.check("book", example[:10], "length") == "unfinished"
    assert script.tally(["valid", "valid", "unfinished"]) == {"valid": 2, "invalid": 0, "unfinished": 1}


def report(with_peer: bool) -> dict:
    overhead = {"where": "engine", "batch": 8, "jump_forward": False, "tokens": 100, "constrained_tok_s": 95.0,
                "unconstrained_tok_s": 100.0, "ratio": 0.95, "mask_us_per_row": 30.0}
    peer = {"requests": 2, "identical": 1, "ratio": 1.2, "sides": {
        side: {"tok_s": 10.0, "seconds": 1.0, "tokens": 10, "valid": 2, "invalid": 0, "unfinished": 0}
        for side in ("hf_accel", "vllm")}} if with_peer else {"skipped": "no venv"}
    return {"command": "bench", "hardware": {"cpu": "cpu"}, "max_tokens": 8, "schemas": ["book"], "total_seconds": 60,
            "validity": [{"mode": "engine", "valid": 3, "invalid": 1, "unfinished": 0}],
            "engine_overhead": [overhead, {**overhead, "batch": 1, "ratio": 1.01, "mask_us_per_row": None}],
            "generate_overhead": [],
            "jump_forward": [{"batch": 1, "mode": "jump-forward + suffix", "tok_s": 20.0, "vs_constrained_plain": 1.6,
                              "identical": True, "forced_tokens": 3, "accepted_tokens": 5, "draft_tokens": 9}],
            "generate_jump_forward": [{"batch": 8, "mode": "jump-forward + suffix", "tok_s": 30.0,
                                       "vs_constrained_plain": 1.4, "identical": True}],
            "compile_beside_decoding": {"steps": 9, "step_ms": 3.0, "step_ms_while_compiling": 3.3, "ratio": 1.1},
            "vllm": peer}


def test_targets_and_page(script):
    for with_peer in (False, True):
        data = report(with_peer)
        data["targets"] = script.targets(data)
        found = {t["name"]: t["met"] for t in data["targets"]}
        assert found["invalid finished outputs (every mode, schema, prompt)"] is False
        assert found["engine constrained / unconstrained tok/s, batch 8"] is True
        assert found["engine constrained / unconstrained tok/s, batch 1"] is True
        assert found["step time while a large schema compiles / without"] is False
        assert found["engine jump-forward + suffix / constrained plain, batch 1"] is True
        assert found["generate jump-forward + suffix / constrained plain, batch 8"] is False
        assert found["engine json_schema / vLLM CPU build tok/s, reference target"] is (True if with_peer else None)
        page = script.render(data)
        assert ("vLLM side by side on the reference target: skipped (no venv)" in page) != with_peer
        assert "| engine | 1 | off | 95 | 100 | 1.01x | - |" in page
        assert "| 8 | jump-forward + suffix | 30 | 1.40x | yes |" in page  # the generate section


def test_mask_clock_restores_what_it_wraps(script):
    import hf_accel.engine.sampler as sampler
    from hf_accel.structured.logits import StructuredLogitsProcessor

    before = (sampler.fill_rows, sampler.argmax_allowed, StructuredLogitsProcessor.allowed)
    with script.MaskClock() as clock:
        assert (sampler.fill_rows, sampler.argmax_allowed) != before[:2]
    assert (sampler.fill_rows, sampler.argmax_allowed, StructuredLogitsProcessor.allowed) == before
    assert clock.microseconds_per_row is None  # nothing masked
