"""hf_accel_int8 / hf_accel_int4 through transformers: quantize on load, save, reload bit-identically, the stock-load
guard, and generation with every hf_accel cache."""

import subprocess
import sys

import pytest
import torch
from tiny_llama import tiny_llama
from transformers import AutoModelForCausalLM, DynamicCache

import hf_accel
from hf_accel import Int4Linear, Int8Linear, WeightOnlyConfig, quantize_model, registry

QUANT_CLASSES = {8: Int8Linear, "8g32": Int8Linear, 4: Int4Linear}
CONFIGS = {8: WeightOnlyConfig(bits=8), "8g32": WeightOnlyConfig(bits=8, group_size=32),  # int8 per channel / group
           4: WeightOnlyConfig(bits=4, group_size=32),
           # int4 with the output layer in int8 and one layer in grouped int8, as a GGUF file mixes them
           "mixed": WeightOnlyConfig(bits=4, group_size=32, module_formats={
               "lm_head": {"bits": 8}, "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}})}


@pytest.fixture(scope="module")
def float_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_float")
    tiny_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _load(path, bits):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=CONFIGS[bits]).eval()


@pytest.mark.parametrize("bits", [8, "8g32", 4])
def test_quantize_on_load_swaps_decoder_linears_and_keeps_embeddings_and_lm_head(float_path, prompt, bits):
    model = _load(float_path, bits)
    linears = [m for name, m in model.named_modules() if ".layers." in name and isinstance(m, torch.nn.Linear)]
    quantized = [m for m in model.modules() if isinstance(m, QUANT_CLASSES[bits])]
    assert not linears and len(quantized) == 2 * 7
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert model.config.quantization_config.quant_method == f"hf_accel_int{CONFIGS[bits].bits}"
    assert all(m.group_size == CONFIGS[bits].group_size for m in quantized)
    reference = AutoModelForCausalLM.from_pretrained(float_path)(prompt).logits
    error = (model(prompt).logits - reference).abs().max().item()
    assert error < (0.2 if bits == 4 else 0.02)


@pytest.mark.parametrize("bits", [8, "8g32", 4])
def test_save_and_reload_pre_quantized_is_bit_identical(float_path, prompt, tmp_path, bits):
    model = _load(float_path, bits)
    logits = model(prompt).logits  # int4: runs the CPU kernel, which re-lays weights out; saving must not notice
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded.model.layers[0].mlp.down_proj, QUANT_CLASSES[bits])
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert saved[key].dtype == loaded[key].dtype and torch.equal(saved[key], loaded[key]), key
    assert torch.equal(reloaded(prompt).logits, logits)


@pytest.mark.parametrize("bits", [8, "8g32", 4, "mixed"])
def test_quantize_model_equals_quantize_on_load_and_leaves_the_float_model(float_path, prompt, tmp_path, bits):
    float_model = AutoModelForCausalLM.from_pretrained(float_path).eval()
    quantized, loaded = quantize_model(float_model, CONFIGS[bits]), _load(float_path, bits)
    if bits == "mixed":  # module_formats: formats other than the rest's, the output layer included
        assert type(quantized.lm_head) is Int8Linear and quantized.lm_head.group_size is None
        down = quantized.model.layers[0].mlp.down_proj
        assert type(down) is Int8Linear and down.group_size == 32
        assert type(quantized.model.layers[1].mlp.down_proj) is Int4Linear
    assert type(float_model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert "quantization_config" not in float_model.config.to_dict()
    assert not any(module.training for module in quantized.modules())  # eval, like the float model
    expected, got = loaded.state_dict(), quantized.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[key], expected[key]) for key in got)
    quantized.save_pretrained(tmp_path)  # a pre-quantized checkpoint, as from a quantize-on-load model
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(reloaded(prompt).logits, loaded(prompt).logits)


def test_a_tied_output_layer_named_in_module_formats_gets_its_own_quantized_weight(prompt, tmp_path):
    """With `tie_word_embeddings`, the output layer shares the input embedding's weight: named in module_formats it
    is quantized from that weight (on load and by quantize_model alike), untied, and stays so after a save, a reload
    and `tie_weights`; the embedding keeps its float weight."""
    tied = tiny_llama()
    tied.config.tie_word_embeddings = True
    tied = type(tied)(tied.config).eval()
    tied.save_pretrained(tmp_path / "float")
    config = CONFIGS["mixed"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config).eval()
    quantized = quantize_model(tied, config, progress=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and tied.config.tie_word_embeddings
    for model in (loaded, quantized):
        assert type(model.lm_head) is Int8Linear and not model.config.tie_word_embeddings
        assert model.model.embed_tokens.weight.dtype == torch.float32
        model.tie_weights()
        assert type(model.lm_head) is Int8Linear
    logits = loaded(prompt).logits
    assert torch.equal(quantized(prompt).logits, logits)
    assert (logits - tied(prompt).logits).abs().max() < 0.1
    loaded.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized").eval()
    assert type(reloaded.lm_head) is Int8Linear and torch.equal(reloaded(prompt).logits, logits)


GUARD_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM
for path in sys.argv[1:]:
    try:
        AutoModelForCausalLM.from_pretrained(path)
        print("LOADED", path)
    except RuntimeError as error:
        print("REFUSED", path, "size mismatch" in str(error) or "ignore_mismatched_sizes" in str(error))
assert "hf_accel" not in sys.modules
"""


def test_stock_transformers_refuses_the_checkpoints_loudly(float_path, tmp_path):
    paths = []
    for bits in (8, 4):
        paths.append(str(tmp_path / f"int{bits}"))
        _load(float_path, bits).save_pretrained(paths[-1])
    result = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, *paths], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [f"REFUSED {path} True" for path in paths]
    for bits in (8, 4):
        assert f"Unknown quantization type, got hf_accel_int{bits}" in result.stderr


def test_group_size_that_does_not_divide_in_features_is_a_value_error(float_path):
    with pytest.raises(ValueError, match="group_size 128 must divide in_features 64"):
        AutoModelForCausalLM.from_pretrained(float_path, quantization_config=WeightOnlyConfig(bits=4, group_size=128))
    with pytest.raises(ValueError, match="cannot quantize 'model.layers.0.self_attn.q_proj'.*divide in_features 64"):
        quantize_model(AutoModelForCausalLM.from_pretrained(float_path), WeightOnlyConfig(bits=4, group_size=128))


@pytest.mark.parametrize("kwargs, message", [
    ({"bits": 3}, "bits must be one of"), ({"bits": 4, "group_size": 48}, "group_size must be one of"),
    ({"bits": 8, "group_size": 16}, "group_size must be one of"), ({"format_version": 2}, "format_version"),
    ({"module_formats": {"lm_head": {"bits": 3}}}, r"module_formats\['lm_head'\]: bits must be one of"),
    ({"module_formats": {"lm_head": {"group_size": 32}}}, "must be a dict with 'bits'"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightOnlyConfig(**kwargs)


def test_config_round_trips_through_a_dict():
    config = WeightOnlyConfig(bits=4, group_size=128, modules_to_not_convert=["mlp.down_proj"])
    again = WeightOnlyConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict() and again.quant_method == "hf_accel_int4"


def test_modules_to_not_convert_keeps_those_layers_float(float_path):
    config = WeightOnlyConfig(bits=8, modules_to_not_convert=["down_proj"])
    model = AutoModelForCausalLM.from_pretrained(float_path, quantization_config=config)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.up_proj, Int8Linear)


def test_unregister_removes_the_methods_and_register_restores_them():
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    hf_accel.unregister()
    try:
        assert "hf_accel_int8" not in AUTO_QUANTIZER_MAPPING
    finally:
        hf_accel.register()
    hf_accel.register()  # idempotent
    assert "hf_accel_int8" in AUTO_QUANTIZER_MAPPING and "hf_accel_int4" in AUTO_QUANTIZER_MAPPING


# user-facing generate kwargs and cache type of every hf_accel cache (those merged into CACHE_BUILDERS so far)
CACHE_CASES = {
    registry.PAGED_ALIAS: ({"cache_implementation": "paged", "cache_config": {"block_size": 4}}, "PagedCache", True),
    registry.SINK_ALIAS: ({"cache_implementation": "sink", "cache_config": {"window_length": 64}}, "SinkCache", True),
    registry.QUANTIZED_ALIAS: ({"cache_implementation": "quantized", "cache_config": {
        "backend": "hf_accel", "nbits": 8, "group_size": 16, "residual_length": 16}}, "QuantizedKVCache", False),
}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("alias", [alias for alias in CACHE_CASES if alias in hf_accel.CACHE_BUILDERS])
def test_quantized_model_generates_with_every_hf_accel_cache(float_path, prompt, bits, alias):
    model = _load(float_path, bits)
    kwargs, cache_type, exact = CACHE_CASES[alias]
    options = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True}
    baseline = model.generate(prompt, **options)
    output = model.generate(prompt, **options, **kwargs)
    assert type(baseline.past_key_values) is DynamicCache
    assert type(output.past_key_values).__name__ == cache_type
    assert output.sequences.shape == baseline.sequences.shape
    if exact:  # lossless caches: token for token the same as DynamicCache on the same quantized model
        assert torch.equal(output.sequences, baseline.sequences)
