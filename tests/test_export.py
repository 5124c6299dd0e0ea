"""`export_vllm` on a tiny random Llama: the compressed-tensors checkpoint loads in transformers, holds a correct
symmetric quantization of the weights with its stored scales, matches hf_accel's quantized model of the same bits
within the quantization error, and carries the config fields vLLM 0.32.0 reads (docs/export.md cites the lines)."""

import json
from pathlib import Path

import pytest
import torch
from export_helpers import run_serve_sh, tiny_folder
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytest.importorskip("compressed_tensors")

from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

from hf_accel import Int4Linear, Int8Linear, MedusaHeads, WeightOnlyConfig, quantize_model  # noqa: E402
from hf_accel.export import compressed  # noqa: E402
from hf_accel.export.vllm import export_vllm  # noqa: E402

MARLIN_GROUP_SIZES = (-1, 32, 64, 128)  # vllm/model_executor/layers/quantization/utils/marlin_utils.py:37


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(1, 4096, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits.float()


def float_model(folder: Path):
    """The tiny model as the export sees it: bf16 weights, computing in fp32."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).float().eval()


def test_group_size_is_the_largest_vllm_group_dividing_every_layer():
    assert compressed.largest_group_size([256, 768]) == 128
    assert compressed.largest_group_size([64, 128]) == 64
    assert compressed.largest_group_size([96, 256]) == 32
    with pytest.raises(ValueError, match="multiple of one of"):
        compressed.largest_group_size([100])


def test_unknown_quant_names_the_argument(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"quant must be one of \['int4', 'int8'\], got 'int3'"):
        export_vllm(tmp_path / "out", model=tiny, quant="int3")
    assert not (tmp_path / "out").exists()


def test_int4_refuses_a_model_no_vllm_group_size_divides_before_writing(tmp_path):
    model = tiny_folder(tmp_path / "odd", intermediate_size=100)  # down_proj has in_features 100
    with pytest.raises(ValueError, match=r"multiple of one of \(128, 64, 32\).*100"):
        export_vllm(tmp_path / "out", model=model, quant="int4")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_config_is_what_vllm_reads_as_weight_only_wna16(tiny, tmp_path, quant):
    out = export_vllm(tmp_path / quant, model=tiny, quant=quant)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    # compressed_tensors.py:235-270 (from_config), :328-340 (config_groups -> QuantizationArgs.model_validate)
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert config["ignore"] == ["lm_head"] and config["kv_cache_scheme"] is None
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    args = QuantizationArgs.model_validate(group["weights"])
    # compressed_tensors.py:698-708 (_is_wNa16_group_channel) and :865-873 (pack-quantized -> CompressedTensorsWNA16)
    assert args.strategy in ("channel", "group") and not args.dynamic and args.actorder is None
    assert args.type == "int" and args.symmetric  # uint8b128 / uint4b8 (compressed_tensors_wNa16.py:36-43)
    assert (args.num_bits, args.strategy, args.group_size) == ((8, "channel", None) if quant == "int8" else
                                                                (4, "group", 64))
    assert (args.group_size or -1) in MARLIN_GROUP_SIZES


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_tensors_have_the_names_and_shapes_vllm_creates(tiny, tmp_path, quant):
    out = export_vllm(tmp_path / quant, model=tiny, quant=quant)
    tensors = load_file(out / "model.safetensors")
    bits, groups = (8, lambda n: 1) if quant == "int8" else (4, lambda n: n // 64)
    for name, linear in compressed.converted_linears(float_model(tiny)).items():
        n_out, n_in = linear.out_features, linear.in_features
        # compressed_tensors_wNa16.py:161-228: weight_packed int32 [out, in*bits/32], weight_scale [out, groups]
        assert tensors[f"{name}.weight_packed"].dtype == torch.int32
        assert tensors[f"{name}.weight_packed"].shape == (n_out, n_in * bits // 32)
        assert tensors[f"{name}.weight_scale"].shape == (n_out, groups(n_in))
        assert tensors[f"{name}.weight_scale"].dtype == torch.bfloat16
        assert tensors[f"{name}.weight_shape"].tolist() == [n_out, n_in]
        assert f"{name}.weight_zero_point" not in tensors and f"{name}.weight" not in tensors
    assert tensors["lm_head.weight"].dtype == torch.bfloat16  # untied here: kept as it is


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_weights_are_within_half_a_step_of_the_float_weights(tiny, tmp_path, quant):
    """Symmetric round-to-nearest with the stored scale s: |w - q s| <= s/2, except that the largest positive
    value can clamp (7.5 -> 7 steps for int4 with s = bf16(absmax / 7.5), up to 1 / (1 - 2^-8) above 7.5 after
    bf16 rounding of s): bound 0.53 s for int4, 0.5 s for int8 (whose scale absmax / 127 leaves a spare code).
    transformers' decompression (in the scale's dtype, bf16) gives q s to within bf16 rounding."""
    out = export_vllm(tmp_path / quant, model=tiny, quant=quant)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    logits(loaded, torch.ones(1, 2, dtype=torch.long))  # transformers decompresses on the first forward
    tensors, source = load_file(out / "model.safetensors"), float_model(tiny)
    bits, bound = (8, 0.5) if quant == "int8" else (4, 0.53)
    for name in compressed.converted_linears(source):
        codes = compressed.unpack_codes(tensors[f"{name}.weight_packed"], bits, tensors[f"{name}.weight_shape"])
        scale = tensors[f"{name}.weight_scale"].float()
        scale = scale.repeat_interleave(codes.shape[1] // scale.shape[1], dim=1)
        dequantized, weight = codes.float() * scale, source.get_submodule(name).weight
        assert ((dequantized - weight).abs() <= bound * scale * (1 + 1e-5)).all(), name
        decompressed = loaded.get_submodule(name).weight
        assert ((decompressed - dequantized).abs() <= dequantized.abs() * 2**-8).all(), name


@pytest.mark.parametrize("quant, bits", [("int8", 8), ("int4", 4)])
def test_logits_match_hf_accel_quantized_model_within_the_quantization_error(tiny, tmp_path, input_ids, quant, bits):
    """Both are quantizations of the same float weights with the same bits, so each is within the quantization
    error of the float model; the test asks the export to be no worse than hf_accel's own (25% slack) and the two
    to differ by at most twice hf_accel's error (the triangle inequality with that slack)."""
    source = float_model(tiny)
    exported = AutoModelForCausalLM.from_pretrained(export_vllm(tmp_path / quant, model=tiny, quant=quant),
                                                    dtype=torch.float32).eval()
    hf_accel_model = quantize_model(source, WeightOnlyConfig(bits=bits, group_size=64 if bits == 4 else None))
    assert any(isinstance(m, (Int8Linear, Int4Linear)) for m in hf_accel_model.modules())
    reference_logits, ours, theirs = logits(source, input_ids), logits(exported, input_ids), logits(
        hf_accel_model, input_ids)
    hf_accel_error = (theirs - reference_logits).abs().max()
    assert hf_accel_error > 0
    assert (ours - reference_logits).abs().max() <= 1.25 * hf_accel_error
    assert (ours - theirs).abs().max() <= 2 * hf_accel_error


def test_int8_codes_are_hf_accels_up_to_the_bf16_scale(tiny, tmp_path):
    """The int8 export uses hf_accel's scale (absmax / 127) stored in bf16: codes differ from `Int8Linear`'s by at
    most one step, only where bf16 rounding of the scale moves w / s across a rounding boundary."""
    out = export_vllm(tmp_path / "int8", model=tiny, quant="int8")
    tensors, source = load_file(out / "model.safetensors"), float_model(tiny)
    hf_accel_model = quantize_model(source, WeightOnlyConfig(bits=8))
    for name in compressed.converted_linears(source):
        ours = compressed.unpack_codes(tensors[f"{name}.weight_packed"], 8, tensors[f"{name}.weight_shape"])
        theirs = hf_accel_model.get_submodule(name).dequantized_weight() / hf_accel_model.get_submodule(
            name).weight_scale.float()[:, None]
        assert (ours.float() - theirs.round()).abs().max() <= 1, name


def test_bf16_export_gives_identical_logits(tiny, tmp_path, input_ids):
    out = export_vllm(tmp_path / "bf16", model=tiny)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert load_file(out / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(logits(exported, input_ids), logits(float_model(tiny), input_ids))
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert not (out / "medusa").exists()


def test_medusa_heads_go_to_medusa_and_into_serve_sh(tiny, tmp_path):
    heads = MedusaHeads.for_model(float_model(tiny), num_heads=2)
    heads.save_pretrained(tmp_path / "heads")
    out = export_vllm(tmp_path / "out", model=tiny, quant="int4", medusa=tmp_path / "heads", served_model_name="tiny")
    medusa_config = json.loads((out / "medusa" / "config.json").read_text())
    assert medusa_config["model_type"] == "medusa" and medusa_config["num_heads"] == 2
    assert (out / "medusa" / "model.safetensors").is_file()
    argv = run_serve_sh(out, tmp_path)
    assert argv[:4] == ["serve", str(out.resolve()), "--served-model-name", "tiny"]
    assert argv[4:8] == ["--max-model-len", "256", "--quantization", "compressed-tensors"]
    assert argv[8] == "--speculative-config"
    assert json.loads(argv[9]) == {"method": "medusa", "model": f"{out.resolve()}/medusa", "num_speculative_tokens": 2}
    assert argv[10:] == ["--port", "8001"]
    readme = (out / "README.md").read_text()
    assert f'"model": "{out.resolve()}/medusa", "num_speculative_tokens": 2' in readme and "vLLM 0.32.0" in readme


def test_serve_sh_without_heads_or_quantization(tiny, tmp_path):
    out = export_vllm(tmp_path / "plain", model=tiny)
    assert run_serve_sh(out, tmp_path)[:6] == ["serve", str(out.resolve()), "--served-model-name", "plain",
                                               "--max-model-len", "256"]
    assert len(run_serve_sh(out, tmp_path)) == 8  # + the passed-through "--port 8001"
