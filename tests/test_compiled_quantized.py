"""Compiled generate with hf_accel's quantized KV cache: `compile_config` with `cache_implementation="quantized"`
(hf_accel backend) runs `compiled/quantized_loop.py` (static code, scale and residual buffers, one graph per step,
the residual's flush on the host) on CPU too. Its tokens equal the eager `QuantizedKVCache`'s (the same groups of
the same tokens, quantized by the same function), at 2, 4 and 8 bits, batch 1 and left-padded batches, with flushes
in the prefill and while decoding; no recompilation across tokens and calls; in-graph sampling warpers and host
processors as the paged loop has them; models with sliding-window layers decode eagerly with a warning; the history
costs a fraction of full precision per token."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from conformance import PAD, make_model, make_prompts
from transformers import CompileConfig

from hf_accel.cache.quantized import QuantizedKVCache
from hf_accel.compiled.paged_rows import PagedRows
from hf_accel.compiled.quantized_loop import compiled_quantized_generate
from hf_accel.compiled.quantized_rows import QuantizedRows, quantized_attention
from hf_accel.compiled.route import route_generate
from hf_accel.kernels.custom_ops import quantized_attention_kernel

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)
SMALL = {"nbits": 4, "group_size": 8, "residual_length": 16}  # flushes every 16 tokens: several per call


def run(model, inputs, compiled: bool, settings=SMALL, **kwargs):
    kwargs.setdefault("max_new_tokens", 40)
    kwargs.setdefault("do_sample", False)
    extra = {"compile_config": COMPILE} if compiled else {}
    return model.generate(**inputs, cache_implementation="quantized",
                          cache_config={"backend": "hf_accel", **settings}, pad_token_id=PAD, **extra, **kwargs)


def unique_graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_the_eager_quantized_cache(arch):
    model = make_model(arch, torch.float32, "sdpa")
    # [9]: short; [5, 23, 14]: padded (the sinks cover the padding); [60, 31]: the prefill itself flushes groups;
    # [2, 3]: prompts shorter than the sink columns (decode tokens fill them first); [20]: exactly R after the sinks
    for lengths in ([9], [5, 23, 14], [60, 31], [2, 3], [20]):
        inputs = make_prompts(lengths, seed=len(lengths))
        assert torch.equal(run(model, inputs, compiled=True), run(model, inputs, compiled=False)), (arch, lengths)


@pytest.mark.parametrize("nbits", [2, 8])
def test_other_bit_widths_and_no_sinks(nbits):
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([7, 19], seed=nbits)
    settings = {**SMALL, "nbits": nbits, "num_fp_sink_tokens": 0}
    expected = run(model, inputs, compiled=False, settings=settings)
    assert torch.equal(run(model, inputs, compiled=True, settings=settings), expected)
    # the codes are in effect: 2 bits change the output of this random model (8 bits need not)
    if nbits == 2:
        dynamic = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
        assert not torch.equal(expected, dynamic)


def test_no_recompilation_across_tokens_and_calls():
    model = make_model("llama", torch.float32, "sdpa")
    run(model, make_prompts([6, 11]), compiled=True, max_new_tokens=3)  # traces the batch > 1 graph
    before = unique_graphs()
    # other row counts, paddings (sink columns), prompt and output lengths (room, live history) and flush counts
    for lengths, new in (([4, 30, 9], 40), ([17, 2], 7), ([3, 3, 3, 3, 3], 25), ([50, 12], 60)):
        inputs = make_prompts(lengths, seed=new)
        assert torch.equal(run(model, inputs, compiled=True, max_new_tokens=new),
                           run(model, inputs, compiled=False, max_new_tokens=new))
    assert unique_graphs() == before


def test_the_compiled_loop_really_runs():
    model = make_model("llama", torch.float32, "sdpa")
    kwargs = {"cache_implementation": "quantized", "cache_config": {"backend": "hf_accel"}, "compile_config": COMPILE}
    route_generate(model, kwargs)
    assert kwargs["custom_generate"] is compiled_quantized_generate
    out = run(model, make_prompts([7, 3]), compiled=True, return_dict_in_generate=True)
    assert out.past_key_values is None  # the buffers live for the call (eagerly, a QuantizedKVCache comes back)
    passed = {**kwargs, "past_key_values": QuantizedKVCache(model.config)}
    passed.pop("custom_generate")
    route_generate(model, passed)
    assert "custom_generate" not in passed  # a cache object passed in is left to transformers


def test_eos_pads_finished_rows():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([10, 6, 17], seed=5)
    free = run(model, inputs, compiled=False)
    eos = int(free[1, -25])  # a token row 1 emits early: it stops there, is padded after, and flushes go on
    expected = run(model, inputs, compiled=False, eos_token_id=eos)
    assert (expected == PAD).sum() > (free == PAD).sum()  # some row did stop early
    assert torch.equal(run(model, inputs, compiled=True, eos_token_id=eos), expected)


def test_sampling_warpers_and_host_processors():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([8, 4], seed=3)
    greedy = run(model, inputs, compiled=False)
    assert torch.equal(run(model, inputs, compiled=True, do_sample=True, top_k=1, temperature=0.7), greedy)
    kwargs = dict(repetition_penalty=1.3, return_dict_in_generate=True, output_scores=True)
    expected, got = run(model, inputs, compiled=False, **kwargs), run(model, inputs, compiled=True, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_models_decode_eagerly_with_a_warning(arch):
    model = make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")
    inputs = make_prompts([6, 9])
    with pytest.warns(UserWarning, match="every layer is full attention"):
        got = run(model, inputs, compiled=True, max_new_tokens=8)
    assert torch.equal(got, run(model, inputs, compiled=False, max_new_tokens=8))


def test_history_costs_a_fraction_of_full_precision_per_token():
    model = make_model("llama", torch.float32, "sdpa")

    def quantized_bytes(columns: int) -> int:
        cache = QuantizedKVCache(model.config, nbits=4, group_size=16, residual_length=16)
        rows = QuantizedRows(model, cache, 2, columns)
        held = (rows.fp_keys, rows.fp_values, rows.key_codes, rows.key_scale, rows.key_minimum, rows.value_codes,
                rows.value_scale, rows.value_minimum)
        return sum(t.numel() * t.element_size() for t in held)

    def paged_bytes(columns: int) -> int:
        return PagedRows(model, [4, 4], columns, 16).kv.nbytes

    grown = quantized_bytes(2016) - quantized_bytes(1008)
    assert grown < 0.3 * (paged_bytes(2016) - paged_bytes(1008))  # codes, scales and minima: a quarter of fp32


@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_the_kernel_equals_the_dense_path(nbits):
    # random buffers, a third of the slots invalid, a live history that is a strided view of a larger room,
    # grouped-query heads: the C++ kernel reading packed codes gives the dense path's attention
    kernel = quantized_attention_kernel()
    if kernel is None:
        pytest.skip("the C++ kernels could not be built here")
    model = make_model("llama", torch.float32, "sdpa")
    rows = QuantizedRows(model, QuantizedKVCache(model.config, nbits=nbits, group_size=8, residual_length=16), 3, 90)
    gen = torch.Generator().manual_seed(nbits)
    for tensor in (rows.fp_keys, rows.fp_values, rows.key_scale, rows.key_minimum, rows.value_scale,
                   rows.value_minimum):
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    for tensor in (rows.key_codes, rows.value_codes):
        tensor.copy_(torch.randint(0, 256, tensor.shape, generator=gen, dtype=torch.uint8))
    rows.valid.copy_(torch.rand(rows.valid.shape, generator=gen) < 0.7)
    rows.num_quantized = 3 * 8
    step = rows._live_step()
    assert step.key_codes.shape[3] < rows.key_codes.shape[3]  # a view of part of the room
    query, key, value = (torch.randn(3, heads, 1, 16, generator=gen) for heads in (4, 2, 2))
    mask = torch.cat((step.valid, torch.ones(3, 1, dtype=torch.bool)), dim=1)
    outputs = []
    for attend in (kernel, None):
        written = []
        out, _ = quantized_attention(SimpleNamespace(layer_idx=1), query, key, value, None, scaling=0.3,
                                     hf_accel_quantized=replace(step, attend=attend), hf_accel_mask=mask,
                                     hf_accel_written=written)
        outputs.append(out)
        assert torch.equal(written[0][0], key[:, :, 0])
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-4)


def test_without_the_kernel_the_dense_path_gives_the_same_tokens(monkeypatch):
    monkeypatch.setenv("HF_ACCEL_PAGED_KERNEL", "0")  # no C++ kernels: the dense path, compiled
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([5, 23, 14], seed=3)
    assert torch.equal(run(model, inputs, compiled=True), run(model, inputs, compiled=False))
