"""`hf-accel finetune` options and errors, the domain data's split rules, and `hf_accel.json` as `hf-accel serve`
reads it (no training here: the path itself runs in test_finetune.py and in the notebook test)."""

import json
from pathlib import Path

import pytest

from hf_accel import cli
from hf_accel.server.command import resolve_serving
from hf_accel.serving_config import ServingConfig, read_serving_config, write_serving_config
from hf_accel.training.finetune_command import build_parser, config_from_args, init_heads
from hf_accel.training.finetune_domain import (
    DomainTexts, is_held_out, package_descriptions, split_descriptions, text_rows,
)


def run_cli(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(["finetune", *argv])
    return exited.value.code, capsys.readouterr().err


def test_finetune_is_a_subcommand_with_help(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and "--lora-steps" in out and "--medusa-steps" in out


@pytest.mark.parametrize("argv, message", [
    ([], "--out"),
    (["--out", "x", "--lora-steps", "0"], "--lora-steps: must be at least 1"),
    (["--out", "x", "--quant", "int3"], "--quant: invalid choice"),
    (["--out", "x", "--seq-len", "16"], "--seq-len: must be at least 48"),
    (["--out", "x", "--held-out-percent", "100"], "--held-out-percent must be in (0, 100)"),
])
def test_bad_arguments_exit_with_a_message_naming_the_option(argv, message, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 2 and message in err


def test_an_out_folder_that_holds_a_model_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    code, err = run_cli(["--out", str(tmp_path)], capsys)
    assert code == 2 and "already holds a model" in err


def test_defaults_and_options_map_to_the_stage_config():
    args = build_parser().parse_args(["--out", "x"])
    config = config_from_args(args)
    assert (config.quant, config.seq_len, config.lora.steps, config.lora.rank, config.medusa_steps) == (
        "int8", 128, 120, 16, 120)
    args = build_parser().parse_args(["--out", "x", "--quant", "none", "--lora-steps", "5", "--init-heads", "none"])
    assert config_from_args(args).quant is None and config_from_args(args).lora.steps == 5
    assert init_heads(args) is None
    assert init_heads(build_parser().parse_args(["--out", "x"])).num_heads == 4, "the reference heads by default"
    assert init_heads(build_parser().parse_args(["--out", "x", "--model", "m"])) is None


def test_domain_split_is_by_distribution_and_stable():
    descriptions = package_descriptions()
    assert descriptions and "hf_accel" not in descriptions
    assert all(len(text) >= 500 for text in descriptions.values())
    splits = split_descriptions(descriptions, held_out_percent=15)
    assert not set(splits.train.sources) & set(splits.held_out.sources)
    assert set(splits.train.sources) | set(splits.held_out.sources) == set(descriptions)
    assert all(is_held_out(name, 15) for name in splits.held_out.sources)
    assert split_descriptions(dict(reversed(descriptions.items()))).held_out.sources[::-1] == splits.held_out.sources


def test_domain_data_errors():
    with pytest.raises(ValueError, match="held_out_percent"):
        split_descriptions({"a": "x" * 600}, held_out_percent=0)
    with pytest.raises(ValueError, match="empty split"):
        split_descriptions({"a": "x" * 600})
    with pytest.raises(ValueError, match="min_chars"):
        package_descriptions(min_chars=10, max_chars=5)


def test_text_rows_spread_over_the_split(tmp_path):
    from transformers import AutoTokenizer

    from hf_accel.reference import ASSETS_DIR

    tokenizer = AutoTokenizer.from_pretrained(ASSETS_DIR / "target", local_files_only=True)
    texts = DomainTexts([f"document {i} " * 40 for i in range(10)], [str(i) for i in range(10)])
    every = text_rows(texts, tokenizer, 32)
    some = text_rows(texts, tokenizer, 32, max_rows=3)
    assert some.shape == (3, 32) and (some[0] == every[0]).all() and (some[-1] == every[-1]).all()
    with pytest.raises(ValueError, match="no row"):
        text_rows(DomainTexts(["tiny"], ["a"]), tokenizer, 32)


def test_serving_config_round_trip_and_errors(tmp_path):
    write_serving_config(tmp_path, ServingConfig("int4", "medusa"))
    assert read_serving_config(tmp_path) == ServingConfig("int4", "medusa")
    assert read_serving_config(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="`quant` must be None or one of"):
        ServingConfig("int3")
    with pytest.raises(ValueError, match="relative"):
        ServingConfig(None, "/abs/heads")
    (tmp_path / "hf_accel.json").write_text(json.dumps({"quant": None, "heads": "x"}))
    with pytest.raises(ValueError, match="unknown keys"):
        read_serving_config(tmp_path)


def test_serve_applies_the_folder_config_unless_options_are_given(tmp_path):
    write_serving_config(tmp_path, ServingConfig("int8", "medusa"))
    assert resolve_serving(str(tmp_path), None, None) == ("int8", tmp_path / "medusa")
    assert resolve_serving(str(tmp_path), "int4", "other") == ("int4", Path("other"))
    assert resolve_serving(None, None, None) == (None, None)
    assert resolve_serving(str(tmp_path / "plain"), "int8", None) == ("int8", None)
