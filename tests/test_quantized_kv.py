"""Quantized KV cache: exact bit packing, error bounds, append-only storage, crop/reorder, logit bounds, bad input."""

import pytest
import torch
from transformers import DynamicCache

import hf_accel
from conformance import make_model, make_prompts
from hf_accel.cache.quantized import QuantizedKVLayer
from hf_accel.quant import ops
from tiny_llama import tiny_llama

NBITS = (8, 4, 2)


@pytest.mark.parametrize("nbits", NBITS)
def test_pack_round_trips_and_really_shrinks(nbits):
    codes = torch.randint(0, 1 << nbits, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = ops.pack(codes, nbits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * nbits // 8)
    assert torch.equal(ops.unpack(packed, nbits), codes)


@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("axis", (-2, -1))
def test_dequantize_is_within_half_a_step_of_each_group(nbits, axis):
    x = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(1)) * 3
    q = ops.quantize(x, nbits, 8, axis)
    step = q.scale.expand(*q.scale.shape[:-2], *((8, 16) if axis == -2 else (2, 8))).reshape(x.shape)
    error = (ops.dequantize(q) - x).abs()
    assert (error <= step / 2 + 1e-5).all()
    assert q.scale.shape == ((2, 3, 4, 1, 16) if axis == -2 else (2, 3, 32, 2, 1))


def test_constant_groups_are_exact_and_dequantize_writes_into_a_view():
    x = torch.full((1, 2, 16, 8), 0.7)
    x[:, :, 8:] = -2.5
    q = ops.quantize(x, 2, 8, -2)
    out = torch.zeros(1, 2, 20, 8)
    ops.dequantize(q, out[:, :, :16])
    assert torch.equal(out[:, :, :16], x) and (out[:, :, 16:] == 0).all()


def _filled_layer(tokens_per_update, nbits=4, group=4, residual=8, seed=0, sinks=0):
    settings = hf_accel.QuantizedKVConfig(nbits=nbits, group_size=group, residual_length=residual,
                                          num_fp_sink_tokens=sinks)
    layer = QuantizedKVLayer(settings)
    gen = torch.Generator().manual_seed(seed)
    states = [torch.randn(2, 2, n, 8, generator=gen) for n in tokens_per_update]
    outputs = [layer.update(s, s * 2) for s in states]
    return layer, states, outputs


def test_history_is_quantized_once_and_appended_never_requantized(monkeypatch):
    quantized_tokens = []
    real_quantize = ops.quantize
    monkeypatch.setattr(ops, "quantize", lambda x, *a: quantized_tokens.append(x.shape[-2]) or real_quantize(x, *a))
    layer, _, _ = _filled_layer([10] + [1] * 6)  # groups of 4, residual 8
    assert quantized_tokens == [8, 8, 8, 8]  # keys and values: the prefill's 2 whole groups, then 8 decoded tokens
    assert layer.quantized_keys.num_tokens == 16 and layer.residual_keys.shape[-2] == 0
    codes_before = layer.quantized_keys.codes.clone()
    for _ in range(9):
        layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert quantized_tokens == [8, 8, 8, 8, 8, 8]  # only the new chunk
    assert torch.equal(layer.quantized_keys.codes[:, :, :16], codes_before)
    assert layer.get_seq_length() == 25 and layer.quantized_keys.num_tokens == 24 and layer.residual_keys.shape[-2] == 1


def test_candidates_stay_full_precision_and_their_crop_is_exact():
    layer, states, outputs = _filled_layer([10, 1, 1, 5])  # groups of 4, residual 8: the 5 "candidates" overflow it
    keys, _ = outputs[-1]
    assert torch.equal(keys[:, :, -5:], states[-1])
    assert torch.equal(layer.residual_keys, states[-1])
    assert layer.quantized_keys.num_tokens == 12  # older tokens flushed
    layer.crop(-3)  # reject 3 candidates: only full-precision data is touched
    assert layer.get_seq_length() == 14 and torch.equal(layer.residual_keys, states[-1][:, :, :2])
    again_keys, _ = layer.update(states[-1][:, :, 2:], states[-1][:, :, 2:] * 2)
    assert torch.equal(again_keys[:, :, -5:], states[-1])
    assert torch.equal(again_keys[:, :, :12], ops.dequantize(layer.quantized_keys))


def test_crop_into_quantized_groups_keeps_what_attention_read():
    layer, _, outputs = _filled_layer([10, 1, 1, 1])  # 8 quantized + 5 residual tokens
    keys, values = outputs[-1]
    layer.crop(-9)  # 4 tokens survive: inside the first quantized group
    probe = torch.zeros(2, 2, 1, 8)
    new_keys, new_values = layer.update(probe, probe)
    assert torch.equal(new_keys[:, :, :4], keys[:, :, :4]) and torch.equal(new_values[:, :, :4], values[:, :, :4])
    assert new_keys.shape[-2] == 5 == layer.get_seq_length()


def test_reorder_selects_rows_of_quantized_and_residual_data():
    layer, _, outputs = _filled_layer([10, 1, 1])
    keys, values = outputs[-1]
    layer.reorder_cache(torch.tensor([1, 1]))
    probe = torch.zeros(2, 2, 1, 8)
    new_keys, new_values = layer.update(probe, probe)
    assert torch.equal(new_keys[:, :, :-1], keys[[1, 1]]) and torch.equal(new_values[:, :, :-1], values[[1, 1]])


@pytest.mark.parametrize("nbits", NBITS)
def test_memory_bytes_counts_codes_scales_and_residual(nbits):
    layer, _, _ = _filled_layer([64, 1], nbits=nbits, group=8, residual=16)
    codes = 2 * 2 * 64 * 8 * nbits // 8  # rows x heads x quantized tokens x head_dim x bits
    # keys: 8 token groups x 8 channels, values: 64 tokens x 1 channel group = 64 per row and head; scale and minimum
    scales = 2 * 2 * (2 * 2 * 64) * 4
    residual = 2 * 2 * 2 * 1 * 8 * 4
    assert layer.nbytes() == 2 * codes + scales + residual


def _teacher_forced_logits(model, cache, ids, mask, prompt_len):
    with torch.no_grad():
        logits = [model(input_ids=ids[:, :prompt_len], attention_mask=mask[:, :prompt_len], past_key_values=cache).logits[:, -1]]
        for t in range(prompt_len, ids.shape[1] - 1):
            position = mask[:, : t + 1].sum(-1, keepdim=True) - 1
            step = model(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache,
                         position_ids=position)
            logits.append(step.logits[:, -1])
    return torch.stack(logits, 1)


# Stated bounds over 32 teacher-forced tokens, tiny random models (logit std ~0.16), groups of 8, residual 8, as
# fractions of the reference logits' std: (mean |difference|, max |difference|). Measured worst: 8 bits 0.001/0.018,
# 4 bits 0.017/0.28, 2 bits 0.081/1.31 (qwen2, llama, gemma2, phi3).
LOGIT_BOUNDS = {8: (0.003, 0.03), 4: (0.025, 0.4), 2: (0.12, 2.0)}


@pytest.mark.parametrize("arch", ("llama", "qwen2", "gemma2", "phi3"))
def test_logits_stay_within_stated_bounds_of_dynamic_cache(arch):
    torch.set_num_threads(1)
    model = make_model(arch, torch.float32, "eager")
    inputs = make_prompts([20, 14, 9], seed=3)
    ids = model.generate(**inputs, max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, 32, dtype=torch.long)], 1)
    prompt_len = inputs["input_ids"].shape[1]
    reference = _teacher_forced_logits(model, DynamicCache(config=model.config), ids, mask, prompt_len)
    errors = []
    for nbits in NBITS:
        cache = hf_accel.QuantizedKVCache(model.config, nbits=nbits, group_size=8, residual_length=8)
        diff = (_teacher_forced_logits(model, cache, ids, mask, prompt_len) - reference).abs() / reference.std()
        mean_bound, max_bound = LOGIT_BOUNDS[nbits]
        assert diff.mean() <= mean_bound and diff.max() <= max_bound, (nbits, diff.mean().item(), diff.max().item())
        errors.append(diff.mean().item())
    assert errors[0] < errors[1] < errors[2]  # fewer bits, more error: the bits really change


def test_fp16_generation_matches_dynamic_cache_at_8_bits():
    model = tiny_llama().to(torch.float16)
    inputs = {"input_ids": torch.tensor([[5, 9, 17, 33, 2, 70, 41, 8, 90, 12, 11, 100], [0] * 5 + [7, 3, 64, 21, 50, 99, 4]])}
    inputs["attention_mask"] = (inputs["input_ids"] != 0).long()
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference = model.generate(**inputs, **kwargs)
    out = model.generate(**inputs, **kwargs, cache_implementation="quantized", return_dict_in_generate=True,
                         cache_config={"backend": "hf_accel", "nbits": 8, "group_size": 8, "residual_length": 8})
    assert isinstance(out.past_key_values, hf_accel.QuantizedKVCache)
    assert out.past_key_values.layers[0].quantized_keys.codes.shape[-2] > 0
    assert torch.equal(out.sequences, reference)


def test_other_backends_stay_stock():
    model = tiny_llama()
    with pytest.raises(Exception) as raised:  # stock QuantizedCache with quanto: not installed here, or it runs
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="quantized",
                       cache_config={"backend": "quanto", "nbits": 4})
    assert "hf_accel" not in str(raised.value)


@pytest.mark.parametrize("cache_config, match", [
    ({"nbits": 3}, r"`nbits` must be one of \(2, 4, 8\)"),
    ({"nbits": "4"}, "`nbits` must be an int"),
    ({"group_size": 0}, "`group_size` must be a positive int"),
    ({"group_size": 12, "residual_length": 24}, r"`group_size` \(12\) must divide the model's head dimension \(16\)"),
    ({"group_size": 8, "residual_length": 12}, "`residual_length` must be a positive multiple of `group_size`"),
    ({"residual": 8}, r"cache_config keys \['residual'\]"),
    ({"group_size": 8, "q_group_size": 8}, "not both"),
])
def test_bad_settings_name_the_argument(cache_config, match):
    model = tiny_llama()
    with pytest.raises((ValueError, TypeError), match=match):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="quantized",
                       cache_config={"backend": "hf_accel", **cache_config})


def test_constructor_validates_too():
    config = tiny_llama().config
    with pytest.raises(ValueError, match="`nbits`"):
        hf_accel.QuantizedKVCache(config, nbits=16)
    with pytest.raises(TypeError, match="`config`"):
        hf_accel.QuantizedKVCache({"hidden_size": 64})
    assert hf_accel.QuantizedKVCache(config, group_size=16, residual_length=16).memory_bytes() == 0


@pytest.mark.parametrize("head_dim, group, residual", [(16, 16, 128), (96, 32, 128), (128, 64, 128), (24, 8, 128)])
def test_default_group_and_residual_fit_the_head_dimension(head_dim, group, residual):
    settings = hf_accel.QuantizedKVConfig(nbits=4).for_head_dim(head_dim)
    assert (settings.group_size, settings.residual_length) == (group, residual)
    assert hf_accel.QuantizedKVConfig(group_size=48).for_head_dim(96).residual_length == 144  # a multiple of 48


def test_default_settings_work_on_a_small_head_dimension_and_explicit_misfits_still_raise():
    model = tiny_llama()  # head dimension 16: below the 64 of the old fixed default
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="quantized",
                         cache_config={"backend": "hf_accel", "nbits": 4}, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, hf_accel.QuantizedKVCache)
    assert out.past_key_values.settings.group_size == 16
    with pytest.raises(ValueError, match=r"`group_size` \(64\) must divide the model's head dimension \(16\)"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache_implementation="quantized",
                       cache_config={"backend": "hf_accel", "nbits": 4, "group_size": 64})
