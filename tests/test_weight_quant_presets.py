"""Quantization presets by name: the configs they build, what they need, bad names, missing backends, loading."""

import importlib.util

import pytest
import torch
from tiny_llama import tiny_llama
from transformers import AwqConfig, BitsAndBytesConfig, FineGrainedFP8Config, GPTQConfig, QuantoConfig

import hf_accel
from hf_accel import WeightOnlyConfig
from hf_accel.quant import presets

NAMES = ["int8", "int4", "bnb-int8", "nf4", "fp4", "quanto-int8", "quanto-int4", "awq", "gptq", "fp8"]
EXPECTED = {
    "int8": (WeightOnlyConfig, {"bits": 8}),
    "int4": (WeightOnlyConfig, {"bits": 4, "group_size": 64}),
    "bnb-int8": (BitsAndBytesConfig, {"load_in_8bit": True}),
    "nf4": (BitsAndBytesConfig, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
    "fp4": (BitsAndBytesConfig, {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}),
    "quanto-int8": (QuantoConfig, {"weights": "int8"}),
    "quanto-int4": (QuantoConfig, {"weights": "int4"}),
    "awq": (AwqConfig, {"bits": 4}),
    "gptq": (GPTQConfig, {"bits": 4}),
    "fp8": (FineGrainedFP8Config, {}),
}


def _can_run(name):
    return next(status for status in hf_accel.list_quantization_presets() if status.name == name)


def test_presets_table_has_every_name_once():
    assert [preset.name for preset in presets.PRESETS] == NAMES
    assert [status.name for status in hf_accel.list_quantization_presets()] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_each_preset_builds_its_transformers_config(name):
    preset = presets.get_preset(name)
    if not all(backend.is_installed for backend in preset.backends):
        pytest.skip(f"{name} needs {[b.package for b in preset.backends]}")
    config = hf_accel.quantization_config(name)
    config_class, attributes = EXPECTED[name]
    assert type(config) is config_class
    assert all(getattr(config, key) == value for key, value in attributes.items())


def test_overrides_reach_the_config():
    assert hf_accel.quantization_config("int4", group_size=128).group_size == 128
    assert hf_accel.quantization_config("int8", modules_to_not_convert=["o_proj"]).modules_to_not_convert == ["o_proj"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="known presets: int8, int4, bnb-int8, nf4, fp4") as error:
        hf_accel.quantization_config("int3")
    assert "'int3'" in str(error.value)


def test_missing_backend_names_the_package_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"pip install bitsandbytes \(or: pip install 'hf_accel\[bnb\]'\)"):
        hf_accel.quantization_config("nf4")
    status = _can_run("nf4")
    assert not status.can_run and "pip install bitsandbytes" in status.reason


def test_native_presets_run_here_and_fp8_needs_a_gpu():
    assert _can_run("int8").can_run and _can_run("int4").can_run and _can_run("int4").reason is None
    if not torch.cuda.is_available():
        fp8 = _can_run("fp8")
        assert not fp8.can_run and fp8.reason.startswith("needs a GPU")


def test_presets_say_what_they_need():
    assert "checkpoint" in presets.get_preset("awq").needs and "dataset=" in presets.get_preset("gptq").needs
    assert presets.get_preset("gptq").backends == (presets.OPTIMUM, presets.GPTQMODEL)


@pytest.mark.parametrize("quant", ["int8", "int4", "bnb-int8", "nf4", "quanto-int8", "quanto-int4"])
def test_load_model_quantizes_by_name(tmp_path, quant):
    if not _can_run(quant).can_run:
        pytest.skip(_can_run(quant).reason)
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    prompt = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    quantized = hf_accel.load_model(str(tmp_path), quant=quant, device_map="cpu")
    assert quantized.is_quantized
    with torch.no_grad():  # not inference_mode: quanto int4 raises "Cannot set version_counter for inference tensor"
        error = (quantized(prompt).logits - model(prompt).logits).abs().max().item()
    assert error < 0.5


def test_load_model_without_quant_is_plain_from_pretrained(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    model = hf_accel.load_model(str(tmp_path))
    assert not getattr(model, "is_quantized", False)
