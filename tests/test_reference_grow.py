"""Depth growth of the reference models: the grown model computes the same function, training can skip the rows the
smaller model saw, and the pipeline starts from a saved model grown to its preset's depth."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_accel.training.data import seeded_batches
from hf_accel.training.depth_growth import grow_depth
from hf_accel.training.reference_build import TrainStart, initial_model
from hf_accel.training.reference_presets import MODEL_PRESETS, TRAIN_RECIPES
from hf_accel.training.reference_trainer import build_model, save_model, train_model
from tiny_corpus import packed_rows, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def rows(tokenizer) -> torch.Tensor:
    return packed_rows(tokenizer, 3)


def trained_tiny(tokenizer, rows) -> torch.nn.Module:
    model = build_model(MODEL_PRESETS["tiny"], tokenizer, seed=0)
    train_model(model, rows, dataclasses.replace(TRAIN_RECIPES["tiny"], steps=5), progress=False)
    return model.eval()


@pytest.mark.parametrize("num_layers", [2, 4, 6])
def test_grown_model_has_the_same_logits(tokenizer, rows, num_layers):
    small = trained_tiny(tokenizer, rows)
    before = {name: p.clone() for name, p in small.state_dict().items()}
    grown = grow_depth(small, num_layers)
    assert grown.config.num_hidden_layers == num_layers and small.config.num_hidden_layers == 2
    assert grown.lm_head.weight is grown.model.embed_tokens.weight  # still tied
    with torch.no_grad():
        torch.testing.assert_close(grown(rows[:2]).logits, small(rows[:2]).logits, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(p, before[name]) for name, p in small.state_dict().items())  # the source is untouched
    if num_layers > 2:  # the added copies start silent, and train like any layer
        assert not grown.model.layers[1].self_attn.o_proj.weight.any()
        assert not grown.model.layers[1].mlp.down_proj.weight.any()
        assert grown.model.layers[1].self_attn.q_proj.weight.any()


@pytest.mark.parametrize("num_layers", [1, 3, 5, 2.0])
def test_grow_refuses_depths_that_are_not_multiples(tokenizer, rows, num_layers):
    with pytest.raises(ValueError, match="num_layers must be a multiple of the model's 2 layers"):
        grow_depth(build_model(MODEL_PRESETS["tiny"], tokenizer, seed=0), num_layers)


def test_skip_batches_starts_on_the_first_unseen_batch(tokenizer, rows):
    recipe = TRAIN_RECIPES["tiny"]
    model = build_model(MODEL_PRESETS["tiny"], tokenizer, seed=0)
    order = seeded_batches(rows, recipe.batch_size, recipe.seed)
    third = [next(order) for _ in range(3)][-1]
    with torch.no_grad():
        expected = model(input_ids=third, labels=third).loss.item()
    result = train_model(model, rows, recipe, time_budget_s=0.0, progress=False, skip_batches=2)
    assert result.steps_done == 1 and result.losses[0] == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="skip_batches"):
        train_model(model, rows, recipe, progress=False, skip_batches=-1)


def test_pipeline_grows_a_saved_model_to_the_preset_depth(tokenizer, rows, tmp_path, monkeypatch):
    save_model(trained_tiny(tokenizer, rows), tokenizer, tmp_path / "target")
    deeper = dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=4)
    monkeypatch.setitem(MODEL_PRESETS, "target", deeper)
    grown = initial_model("target", tokenizer, seed=0, grow_from=tmp_path)
    assert grown.config.num_hidden_layers == 4
    assert build_model(deeper, tokenizer, seed=0).config.num_hidden_layers == 4  # the preset alone: fresh weights
    monkeypatch.setitem(MODEL_PRESETS, "target", dataclasses.replace(deeper, hidden_size=64, num_heads=4))
    with pytest.raises(ValueError, match=r"grow_from: .* has \(hidden, intermediate, heads\)"):
        initial_model("target", tokenizer, seed=0, grow_from=tmp_path)


def test_start_record_carries_the_grown_from_models_own_record(tmp_path):
    earlier = {"steps_done": 10, "train_seconds": 60.0, "start": {"earlier": {"steps_done": 5}}}
    (tmp_path / "report.json").write_text(json.dumps({"models": {"target": earlier}}))
    record = TrainStart(grow_from=tmp_path, skip_batches=10).record("target")
    assert record == {"grow_from": str(tmp_path), "skip_batches": 10, "earlier": earlier}  # stages nest
    assert "earlier" not in TrainStart(grow_from=tmp_path, skip_batches=10).record("draft")  # no draft there
    assert TrainStart().record("target") == {}
