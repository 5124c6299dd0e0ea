"""`export_vllm(lora_modules=...)` / `hf-accel export --lora-modules`: peft adapters checked against the base and
copied under OUT/loras/NAME unchanged, `serve.sh` serving them with vLLM 0.32's `--enable-lora` flags (the rank
rounded up to a value vLLM accepts, a slot per adapter and an empty one for base tokens), adapters that do not fit
the base refused by name before anything is written."""

import importlib
import json
from pathlib import Path

import pytest
import torch
from export_helpers import run_serve_sh, tiny_folder
from transformers import AutoModelForCausalLM

from hf_accel import MedusaHeads
from hf_accel.cli import main
from hf_accel.export.vllm import export_vllm
from hf_accel.export.vllm_lora import vllm_max_lora_rank

peft = pytest.importorskip("peft")

ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("tiny"))


def save_adapter(model_folder, out, seed: int = 0, **settings):
    """A peft adapter of the model in `model_folder` (random A and B), saved to `out`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **settings)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {"sql": save_adapter(tiny, folder / "sql", r=4, target_modules=["q_proj", "v_proj"]),
            "docs": save_adapter(tiny, folder / "docs", seed=1, r=24,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])}


def test_vllm_rank_is_the_next_value_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 8, 9, 24, 64, 300, 320, 512)] == [8, 8, 16, 32, 64, 320, 320, 512]
    with pytest.raises(ValueError, match=r"rank 513 is over vLLM's largest --max-lora-rank \(512\)"):
        vllm_max_lora_rank(513)


def test_adapters_are_copied_and_served_with_enable_lora(tiny, adapters, tmp_path):
    out = export_vllm(tmp_path / "base", model=tiny, lora_modules=adapters)
    assert {path.name for path in (out / "loras").iterdir()} == {"sql", "docs"}
    for name, source in adapters.items():
        assert {path.name for path in (out / "loras" / name).iterdir()} == ADAPTER_FILES
        for file_name in ADAPTER_FILES:
            assert (out / "loras" / name / file_name).read_bytes() == (source / file_name).read_bytes()
    argv, here = run_serve_sh(out, tmp_path), str(out.resolve())
    assert argv == ["serve", here, "--served-model-name", "base", "--max-model-len", "256", "--enable-lora",
                    "--max-lora-rank", "32", "--max-loras", "3", "--lora-modules", f"sql={here}/loras/sql",
                    f"docs={here}/loras/docs", "--port", "8001"]
    readme = (out / "README.md").read_text()
    assert "`loras/docs/`: the peft LoRA adapter `docs` (rank 24)" in readme
    assert f"--lora-modules sql={here}/loras/sql docs={here}/loras/docs" in readme


def test_heads_speculate_with_adapters_only_when_asked(tiny, adapters, tmp_path):
    heads = MedusaHeads.for_model(AutoModelForCausalLM.from_pretrained(tiny), num_heads=2)
    heads.save_pretrained(tmp_path / "heads")
    quiet = export_vllm(tmp_path / "quiet", model=tiny, medusa=tmp_path / "heads",
                        lora_modules={"sql": adapters["sql"]})
    argv = run_serve_sh(quiet, tmp_path)
    assert (quiet / "medusa" / "config.json").is_file() and "--speculative-config" not in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "8" and argv[argv.index("--max-loras") + 1] == "2"
    asked = export_vllm(tmp_path / "asked", model=tiny, medusa=tmp_path / "heads", speculative="medusa",
                        lora_modules={"sql": adapters["sql"]})
    argv = run_serve_sh(asked, tmp_path)
    assert "--enable-lora" in argv and json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "medusa"


def test_the_command_takes_lora_modules(tiny, adapters, tmp_path, capsys):
    out = tmp_path / "cli"
    entries = [f"{name}={path}" for name, path in adapters.items()]
    assert main(["export", "--format", "vllm", "--model", str(tiny), "--lora-modules", *entries, str(out)]) == 0
    assert {path.name for path in (out / "loras").iterdir()} == {"sql", "docs"}
    assert '--lora-modules "sql=${HERE}/loras/sql" "docs=${HERE}/loras/docs"' in (out / "serve.sh").read_text()
    assert main(["export", str(tmp_path / "first"), "--format", "vllm", "--model", str(tiny), "--lora-modules",
                 *entries]) == 0
    for argv, message in [(["--lora-modules", "sql", str(tmp_path / "bad")], "entry 'sql' must be NAME=PATH"),
                          (["--lora-modules", "sql=x"], "required: out")]:
        with pytest.raises(SystemExit) as exited:
            main(["export", "--format", "vllm", *argv])
        assert exited.value.code == 2 and message in capsys.readouterr().err
    assert main(["export", "--format", "vllm", "--model", str(tiny), "--lora-modules", f"x={tmp_path / 'none'}",
                 str(tmp_path / "missing")]) == 2
    assert "lora_modules: adapter 'x': no adapter_config.json" in capsys.readouterr().err


def wider_adapter(tmp_path):
    wide = tiny_folder(tmp_path / "wide", intermediate_size=96)
    return save_adapter(wide, tmp_path / "wide-adapter", r=4, target_modules=["down_proj"])


@pytest.mark.parametrize("case, message", [
    ("wider", r"lora_modules: adapter 'bad': 'model.layers.0.mlp.down_proj' has lora_A \(4, 96\).* do not fit"),
    ("dora", r"lora_modules: adapter 'bad': use_dora cannot be served unmerged"),
    ("lm_head", r"lora_modules: adapter 'bad': the base model has no adaptable Linear 'lm_head'"),
    ("missing", r"lora_modules: adapter 'bad': no adapter_config.json"),
])
def test_adapters_that_do_not_fit_the_base_are_refused_before_writing(tiny, tmp_path, case, message):
    made = {
        "wider": lambda: wider_adapter(tmp_path),
        "dora": lambda: save_adapter(tiny, tmp_path / "dora", r=4, target_modules=["q_proj"], use_dora=True),
        "lm_head": lambda: save_adapter(tiny, tmp_path / "head", r=4, target_modules=["lm_head"]),
        "missing": lambda: tmp_path / "nothing-here",
    }[case]()
    with pytest.raises(ValueError, match=message):
        export_vllm(tmp_path / "out", model=tiny, lora_modules={"bad": made})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("names, message", [
    ({"a b": None}, r"adapter name 'a b' must be letters, digits"),
    ({"../up": None}, r"adapter name '../up' must be letters, digits"),
    ({"base": None}, r"adapter name 'base' is the base's served model name"),
])
def test_bad_names_are_refused(tiny, adapters, tmp_path, names, message):
    lora_modules = {name: adapters["sql"] for name in names}
    with pytest.raises(ValueError, match=message):
        export_vllm(tmp_path / "base", model=tiny, lora_modules=lora_modules)
    assert not (tmp_path / "base").exists()


def test_quantized_export_with_adapters_is_refused(tiny, adapters, tmp_path):
    with pytest.raises(ValueError, match=r"lora_modules cannot be exported with quant='int4'.*not verified"):
        export_vllm(tmp_path / "q", model=tiny, quant="int4", lora_modules=adapters)
    assert not (tmp_path / "q").exists()


def test_the_vllm_check_skips_without_its_venv(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    check = importlib.import_module("check_vllm_lora")
    assert check.main(["--vllm-venv", str(tmp_path / "absent"), "--out", str(tmp_path)]) == 0
    assert f"skipped: no vLLM venv at {tmp_path / 'absent'}" in capsys.readouterr().out
    assert not (tmp_path / "docs").exists() and not (tmp_path / "benchmarks").exists()
