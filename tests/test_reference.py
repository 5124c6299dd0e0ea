"""Reference models: corpus order and split, tokenizer round trip, a tiny training run, offline loading."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_accel import reference
from hf_accel.reference import corpus, sources
from hf_accel.reference.evaluate import greedy_agreement, perplexity
from hf_accel.training.reference_command import main, recipe_for
from hf_accel.training.reference_presets import MODEL_PRESETS, TRAIN_RECIPES, ModelPreset, TrainRecipe
from hf_accel.training.reference_tokenizer import END_OF_TEXT, save_tokenizer, train_tokenizer
from hf_accel.training.reference_trainer import SAVE_DTYPE, Checkpointing, build_model, lr_at, save_model, train_model



@pytest.fixture(scope="module")
def train() -> corpus.Corpus:
    return corpus.load_split("train")


@pytest.fixture(scope="module")
def small_tokenizer(train):
    # the first 40 train files (~300 kB): plenty of merges for a 512-token vocabulary, trained in a fraction of a second
    return train_tokenizer(train.texts[:40], vocab_size=512)


@pytest.fixture(scope="module")
def held_out() -> corpus.Corpus:
    return corpus.load_split("held_out")


def test_default_corpus_takes_the_stdlib_and_the_fixed_packages(train, held_out):
    built = corpus.default_corpus()
    assert [record.name for record in built.sources] == ["stdlib", *sources.TRAIN_PACKAGES, *sources.HELD_OUT_PACKAGES]
    assert "stdlib/os.py" in train.paths and "stdlib/json/decoder.py" in train.paths
    assert any(path.startswith("transformers/transformers/models/") for path in train.paths)
    excluded = ("/test/", "/tests/", "/testing/", "/site-packages/", "/idlelib/", "/encodings/", "/_sysconfigdata_")
    every = train.paths + held_out.paths + built.splits["held_out_packages"].paths
    assert not [path for path in every if any(part in "/" + path for part in excluded)]
    assert len(set(every)) == len(every)
    assert all(record.licence and record.licence != "unknown" for record in built.sources)
    transformers = next(record for record in built.sources if record.name == "transformers")
    assert transformers.near_duplicates > 500  # the copied modeling files


def test_splits_are_disjoint_by_file_and_by_package(train, held_out):
    packages = corpus.load_split("held_out_packages")
    held_out_sources = {path.split("/")[0] for path in packages.paths}
    assert held_out_sources == set(sources.HELD_OUT_PACKAGES)
    assert not {path.split("/")[0] for path in train.paths + held_out.paths} & held_out_sources
    assert set(train.paths).isdisjoint(held_out.paths)
    assert 0.02 < held_out.num_files / (train.num_files + held_out.num_files) < 0.10
    assert all(corpus.split_of(path.split("/", 1)[1]) == "held_out" for path in held_out.paths)
    assert corpus.load_split("held_out").fingerprint == held_out.fingerprint
    with pytest.raises(ValueError, match="split"):
        corpus.load_split("validation")


def test_tokenizer_round_trips_held_out_text_and_loads_from_folder(small_tokenizer, held_out, tmp_path):
    save_tokenizer(small_tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded) == 512
    assert loaded.eos_token == loaded.bos_token == loaded.pad_token == END_OF_TEXT
    assert loaded.convert_tokens_to_ids(END_OF_TEXT) == 0
    for text in held_out.texts[:5] + ["x = 'é ü 中文 🙂'\r\n\ttabs  and   spaces\n"]:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == text
        assert ids == small_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_template_renders_role_lines_and_round_trips_exactly(small_tokenizer, tmp_path):
    save_tokenizer(small_tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Sort a list:\n  xs = [3, 1]  # é 🙂"}]
    text = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|system|>\nYou write Python.<|endoftext|>\n<|user|>\nSort a list:\n  xs = [3, 1]  # é 🙂"
                    "<|endoftext|>\n<|assistant|>\n")
    ids = loaded.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert loaded.decode(ids) == text
    assert ids.count(loaded.eos_token_id) == 2  # one end-of-turn token per message
    assert not loaded.apply_chat_template(messages, tokenize=False).endswith("<|assistant|>\n")


def test_tokenizer_training_is_deterministic(train, small_tokenizer):
    again = train_tokenizer(train.texts[:40], vocab_size=512)
    assert again.get_vocab() == small_tokenizer.get_vocab()


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    recipe = TrainRecipe(steps=10, batch_size=1, seq_len=8, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    lrs = [lr_at(step, recipe) for step in range(10)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert lr_at(10, recipe) == pytest.approx(0.1)
    assert lr_at(2, recipe, time_fraction=1.0) == pytest.approx(0.1)  # a budgeted run decays on time too
    assert lr_at(0, recipe, time_fraction=1.0) == 0.5  # warmup stays on steps


def test_presets_validate_and_have_the_promised_sizes():
    with pytest.raises(ValueError, match="num_heads"):
        ModelPreset(hidden_size=30, num_layers=1, num_heads=4, num_kv_heads=1, intermediate_size=8, context_length=8)
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainRecipe(steps=5, batch_size=1, seq_len=8, lr=1e-3, warmup_steps=6)
    sizes = {}
    for name in ("target", "draft"):
        config = MODEL_PRESETS[name].to_config(vocab_size=4096, special_token_id=0)
        with torch.device("meta"):
            sizes[name] = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        assert config.max_position_embeddings >= 512 and TRAIN_RECIPES[name].seq_len >= 512
    assert 3e6 <= sizes["target"] <= 15e6
    assert 4 <= sizes["target"] / sizes["draft"] <= 13
    assert MODEL_PRESETS["target"].num_layers >= 4 * MODEL_PRESETS["draft"].num_layers  # per-token cost ratio


def test_tiny_training_lowers_loss_and_save_load_round_trips(train, small_tokenizer, tmp_path):
    ids = corpus.tokenize(train.texts[:10], small_tokenizer)
    recipe = TRAIN_RECIPES["tiny"]
    rows = corpus.pack_sequences(ids, small_tokenizer.eos_token_id, recipe.seq_len)
    model = build_model(MODEL_PRESETS["tiny"], small_tokenizer, seed=0)
    before = perplexity(model, rows[:8])
    result = train_model(model, rows, recipe, progress=False)
    assert result.steps_done == recipe.steps and result.tokens_seen == recipe.num_tokens
    assert result.final_loss(5) < result.losses[0] - 0.5
    assert perplexity(model, rows[:8]) < before

    save_model(model, small_tokenizer, tmp_path / "target")
    assert (tmp_path / "target" / "model.safetensors").is_file()
    loaded, tokenizer = reference.load("target", assets_dir=tmp_path)
    assert next(loaded.parameters()).dtype == torch.float32 and not loaded.training
    assert tokenizer.get_vocab() == small_tokenizer.get_vocab()
    for (name, saved), original in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(saved, original.to(SAVE_DTYPE).float()), name
    assert greedy_agreement(loaded, loaded, rows[:2]) == 1.0


def test_time_budget_stops_training_early(train, small_tokenizer):
    ids = corpus.tokenize(train.texts[:3], small_tokenizer)
    recipe = TRAIN_RECIPES["tiny"]
    rows = corpus.pack_sequences(ids, small_tokenizer.eos_token_id, recipe.seq_len)
    model = build_model(MODEL_PRESETS["tiny"], small_tokenizer, seed=0)
    result = train_model(model, rows, recipe, time_budget_s=0.0, progress=False)
    assert result.steps_done == 1 and math.isfinite(result.losses[0])


def test_checkpoint_resume_continues_exactly_like_an_uninterrupted_run(train, small_tokenizer, tmp_path):
    ids = corpus.tokenize(train.texts[:3], small_tokenizer)
    recipe = TRAIN_RECIPES["tiny"]
    rows = corpus.pack_sequences(ids, small_tokenizer.eos_token_id, recipe.seq_len)
    whole = build_model(MODEL_PRESETS["tiny"], small_tokenizer, seed=0)
    expected = train_model(whole, rows, recipe, progress=False)
    checkpointing = Checkpointing(tmp_path / "ckpt", every=7, resume=True)
    cut = build_model(MODEL_PRESETS["tiny"], small_tokenizer, seed=0)
    first = train_model(cut, rows, recipe, time_budget_s=0.0, progress=False, checkpointing=checkpointing)
    assert first.steps_done == 1 and checkpointing.path.is_file()  # step 0 is warmup: same lr as the whole run
    resumed_model = build_model(MODEL_PRESETS["tiny"], small_tokenizer, seed=1)  # weights come from the checkpoint
    resumed = train_model(resumed_model, rows, recipe, progress=False, checkpointing=checkpointing)
    assert resumed.steps_done == recipe.steps and resumed.losses == expected.losses
    for a, b in zip(resumed_model.parameters(), whole.parameters()):
        assert torch.equal(a, b)
    cut_short = train_model(build_model(MODEL_PRESETS["tiny"], small_tokenizer, seed=0), rows, recipe, 0.0, False,
                            Checkpointing(tmp_path / "short", every=7, resume=True))
    again = train_model(resumed_model, rows, recipe, time_budget_s=0.0, progress=False,
                        checkpointing=Checkpointing(tmp_path / "short", every=7, resume=True))
    assert again.losses == cut_short.losses  # resumed with its budget spent: no further step
    with pytest.raises(ValueError, match="every"):
        Checkpointing(tmp_path, every=0)


def test_load_names_the_missing_assets_and_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-reference"):
        reference.load("draft", assets_dir=tmp_path)
    with pytest.raises(ValueError, match="target"):
        reference.load("medium", assets_dir=tmp_path)


def training_imports(path: Path) -> list[str]:
    """The modules of a package named `training` that a file imports (relative ones as written: `..training.data`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return [module for module in found if "training" in module.lstrip(".").split(".")]


def test_reference_package_imports_no_training_code(tmp_path):
    """Loading the shipped models must not pull the trainers in: the training code lives in hf_accel.training."""
    files = sorted(Path(reference.__file__).parent.glob("*.py"))
    assert {path.name for path in files} >= {"__init__.py", "corpus.py", "held_out.py"}
    assert {path.name: training_imports(path) for path in files} == {path.name: [] for path in files}
    (tmp_path / "example.py").write_text("from ..training.data import token_rows\nimport hf_accel.training.lora\n")
    assert training_imports(tmp_path / "example.py") == ["..training.data", "hf_accel.training.lora"]


def test_main_rejects_unknown_options():
    with pytest.raises(SystemExit):
        main(["--which", "medium"])


def test_steps_override_scales_warmup():
    assert recipe_for("target", None) == TRAIN_RECIPES["target"]
    short = recipe_for("target", TRAIN_RECIPES["target"].steps // 10)
    assert short.steps == TRAIN_RECIPES["target"].steps // 10
    assert short.warmup_steps == max(1, round(TRAIN_RECIPES["target"].warmup_steps / 10))
    assert recipe_for("draft", 1).warmup_steps == 1


def test_report_update_keeps_other_models_and_replaces_what_was_measured():
    from hf_accel.training.reference_build import _updated_report

    earlier = {"models": {"draft": {"steps_done": 5, "held_out_perplexity": 9.0}}, "greedy_agreement": 0.4,
               "baseline_target": {"parameters": 1}}
    trained = {"target": {"steps_done": 7}}
    measured = {"perplexity": {"target": {"held_out": 3.0}, "draft": {"held_out": 4.0}}, "greedy_agreement": 0.5}
    report = _updated_report(earlier, {"splits": {}}, trained, measured)
    assert report["models"] == {"draft": {"steps_done": 5, "held_out_perplexity": {"held_out": 4.0}},
                                "target": {"steps_done": 7, "held_out_perplexity": {"held_out": 3.0}}}
    assert report["greedy_agreement"] == 0.5 and report["baseline_target"] == {"parameters": 1}
    assert report["corpus"] == {"splits": {}} and "torch" in report and "python" in report
