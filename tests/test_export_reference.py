"""`hf-accel export --format vllm` end to end on the reference target (with its EAGLE head and Medusa heads), and the
command's errors for bad input."""

import json
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("compressed_tensors")

from hf_accel import WeightOnlyConfig, quantize_model, reference  # noqa: E402
from hf_accel.cli import main  # noqa: E402
from hf_accel.speculative.medusa_heads import MedusaHeads  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (reference.has_assets() and (reference.ASSETS_DIR / "medusa" / "medusa_config.json").is_file()
         and (reference.ASSETS_DIR / "eagle" / "eagle_config.json").is_file()),
    reason="reference models or heads not built")


@pytest.fixture(scope="module")
def target():
    model, tokenizer = reference.load("target")
    return model, reference.held_out_sequences(tokenizer, seq_len=96, max_rows=2)


def logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits.float()


def test_reference_int4_export_with_heads_loads_and_stays_within_the_quantization_error(tmp_path, target, capsys):
    model, input_ids = target
    out = tmp_path / "target-int4"
    assert main(["export", "--format", "vllm", "--quant", "int4", str(out)]) == 0
    assert f"bash {out / 'serve.sh'}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 128
    heads = json.loads((out / "medusa" / "config.json").read_text())
    assert heads["num_heads"] == MedusaHeads.from_pretrained(reference.ASSETS_DIR / "medusa").num_heads
    script = (out / "serve.sh").read_text()
    subprocess.run(["bash", "-n", str(out / "serve.sh")], check=True)
    assert "--max-model-len 512" in script and '\\"model\\": \\"${HERE}/eagle3\\"' in script
    eagle = json.loads((out / "eagle3" / "config.json").read_text())
    assert eagle["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_accel_int4 = quantize_model(model, WeightOnlyConfig(bits=4, group_size=128))
    float_logits, ours, theirs = logits(model, input_ids), logits(exported, input_ids), logits(hf_accel_int4,
                                                                                                input_ids)
    hf_accel_error = (theirs - float_logits).abs().max()
    assert (ours - float_logits).abs().max() <= 1.25 * hf_accel_error  # same bound as tests/test_export.py
    assert (ours - theirs).abs().max() <= 2 * hf_accel_error
    assert (ours.argmax(-1) == float_logits.argmax(-1)).float().mean() > 0.8  # v2 target: 0.875 on this row


def test_reference_bf16_export_gives_identical_logits(tmp_path, target):
    model, input_ids = target
    assert main(["export", "--format", "vllm", str(tmp_path / "bf16"), "--served-model-name", "ref"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    assert torch.equal(logits(exported, input_ids), logits(model, input_ids))  # stored bf16 either way
    assert "--served-model-name ref" in (tmp_path / "bf16" / "serve.sh").read_text()


@pytest.mark.parametrize("argv, option", [
    (["--format", "onnx"], "--format"), (["--format", "vllm", "--quant", "int3"], "--quant"), ([], "--format")])
def test_bad_option_values_name_the_option(tmp_path, capsys, argv, option):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", *argv, str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_non_empty_out_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--format", "vllm", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert main(["export", "--format", "vllm", "--overwrite", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "keep.txt").is_file()


def test_model_folder_without_config_names_model(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["export", "--format", "vllm", "--model", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model " in err and "no config.json" in err
    assert not (tmp_path / "out").exists()


def test_medusa_folder_without_heads_names_medusa(tmp_path, capsys):
    (tmp_path / "heads").mkdir()
    assert main(["export", "--format", "vllm", "--medusa", str(tmp_path / "heads"), str(tmp_path / "out")]) == 2
    assert "medusa " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
