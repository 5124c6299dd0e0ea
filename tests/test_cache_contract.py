"""Every hf_accel cache honours transformers' whole Cache contract, held against `DynamicCache` on the conformance
suite's tiny architectures (full, all-sliding and hybrid):

- structure: after greedy, sampling, beam and assisted decoding the returned cache has DynamicCache's number of layers,
  and each layer's `keys` / `values` are `[batch, kv_heads, seq_len, head_dim]` of the same shape and values;
- continuation: a generation continued from a returned cache (`input_ids` or `inputs_embeds`) gives the tokens of one
  long call and a cache that compares equal (`torch.testing.assert_close`) with the long call's;
- methods: `get_seq_length`, `get_mask_sizes`, `crop`, `reorder_cache`, `batch_repeat_interleave` and
  `batch_select_indices` leave the same tokens as DynamicCache's, and the next forward gives the same logits;
  `is_sliding`, `is_initialized` and `get_max_length` answer as DynamicCache's;
- `torch.compile`: a compiled forward over our caches gives eager's logits, as it does over DynamicCache.

The quantized cache (int8, groups of 8, residual 8: most of the history really quantized) is held within its
quantization error: values to `QUANTIZED_ATOL`, tokens as in tests/test_quantized_conformance.py (a first difference
only at a near tie of the reference's logits).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

import hf_accel
from conformance import ARCHITECTURES, REFERENCE, CacheSpec, assert_same_tokens, generate, make_draft_model, \
    make_model, make_prompts

QUANTIZED_ATOL = 0.05  # int8 over groups of 8: half a step of the tiny models' K/V ranges, with margin
NEW_TOKENS = 8  # prompts of 9-12 tokens + 8: past the sliding window (8) of mistral, qwen2, gemma2, gemma3
SINK_WINDOW = {"window_length": 64, "num_sink_tokens": 4}  # holds every token here: the same tokens as DynamicCache
QUANTIZED = {"backend": "hf_accel", "nbits": 8, "group_size": 8, "residual_length": 8}


@functools.lru_cache(maxsize=None)
def _factories() -> dict[str, Callable[[PreTrainedModel], Cache]]:
    return {
        "paged": lambda model: hf_accel.PagedCache(model.config, block_size=4),  # many block boundaries and evictions
        "quantized": lambda model: hf_accel.QuantizedKVCache(model.config, nbits=8, group_size=8, residual_length=8),
        "sink": lambda model: hf_accel.SinkCache(model.config, **SINK_WINDOW),
    }


SPECS = {
    "paged": CacheSpec("paged", hf_accel.PagedCache,
                       {"cache_implementation": "paged", "cache_config": {"block_size": 4}}),
    "quantized": CacheSpec("quantized-int8", hf_accel.QuantizedKVCache,
                           {"cache_implementation": "quantized", "cache_config": QUANTIZED}, tie_atol=1e-3),
    "sink": CacheSpec("sink", hf_accel.SinkCache, {"cache_implementation": "sink", "cache_config": SINK_WINDOW}),
}
ATOL = {"paged": 0.0, "quantized": QUANTIZED_ATOL, "sink": 0.0}
ARCHS = tuple(ARCHITECTURES)
MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=0),
    "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "assisted": dict(do_sample=False),  # plus the draft model; batch size 1
}


def _model(arch: str) -> PreTrainedModel:
    return make_model(arch, torch.float32, "sdpa" if "sdpa" in ARCHITECTURES[arch][1] else "eager")


def _decode(model: PreTrainedModel, spec: CacheSpec, mode: str):
    inputs = make_prompts([12] if mode == "assisted" else [12, 9], seed=21)
    extra = {"assistant_model": make_draft_model(model)} if mode == "assisted" else {}
    torch.manual_seed(7)
    return generate(model, spec, inputs, max_new_tokens=NEW_TOKENS, **MODES[mode], **extra)


@functools.lru_cache(maxsize=None)
def _reference(arch: str, mode: str):
    return _decode(_model(arch), REFERENCE, mode)


def assert_same_cache(reference: Cache, got: Cache, atol: float, values: bool = True) -> None:
    """Same number of layers, and per layer the same `keys` / `values` shapes and sequence length (and, with
    `values`, the same tensors within `atol`)."""
    assert len(got.layers) == len(reference.layers), f"{len(got.layers)} layers, DynamicCache {len(reference.layers)}"
    assert got.get_seq_length() == reference.get_seq_length()
    for index, (expected, layer) in enumerate(zip(reference.layers, got.layers)):
        for name in ("keys", "values"):
            want, have = getattr(expected, name), getattr(layer, name)
            if want is None:  # not written yet
                assert have is None, f"layer {index} {name}: {tuple(have.shape)}, DynamicCache has none yet"
                continue
            assert have.shape == want.shape, f"layer {index} {name}: {tuple(have.shape)}, expected {tuple(want.shape)}"
            if values:
                tolerance = {"atol": atol, "rtol": 0} if atol else {}  # exact caches: float32's default tolerance
                torch.testing.assert_close(have, want, **tolerance, msg=f"layer {index} {name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", SPECS)
def test_structure_after_decoding(cache, arch, mode):
    model, spec = _model(arch), SPECS[cache]
    reference, got = _reference(arch, mode), _decode(model, spec, mode)
    assert_same_tokens(reference, got, spec, 12)
    # a near tie may flip a lossy cache's history, or (beams) the history of a beam that is not returned
    same_history = torch.equal(reference.sequences, got.sequences) and not (ATOL[cache] and mode == "beams")
    assert_same_cache(reference.past_key_values, got.past_key_values, ATOL[cache], values=same_history)


def _continue(model: PreTrainedModel, spec: CacheSpec, embeds: bool, split: int | None):
    """Greedy over two left-padded prompts, `NEW_TOKENS` in one call (`split` None) or in two, the second continuing
    from the first's returned cache; by `input_ids`, or by `inputs_embeds` (sequences then hold new tokens only)."""
    inputs = make_prompts([12, 9], seed=22)
    embed = model.get_input_embeddings()
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)

    def run(ids: torch.Tensor, mask: torch.Tensor, new: int, **more):
        prompt = {"inputs_embeds": embed(ids)} if embeds else {"input_ids": ids}
        out = model.generate(**prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kwargs, **more)
        assert type(out.past_key_values) is spec.expected_type
        return out

    with torch.no_grad():
        first = run(inputs["input_ids"], inputs["attention_mask"], split or NEW_TOKENS, **spec.kwargs(model))
        if split is None:
            return first
        ids = torch.cat([inputs["input_ids"], first.sequences[:, -split:]], dim=1)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(first.sequences[:, -split:])], dim=1)
        second = run(ids, mask, NEW_TOKENS - split, past_key_values=first.past_key_values)
        second.sequences = torch.cat([first.sequences, second.sequences[:, -(NEW_TOKENS - split):]], dim=1)
        return second


@pytest.mark.parametrize("embeds", [False, True], ids=["input_ids", "inputs_embeds"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", SPECS)
def test_continuation_equals_one_long_call(cache, arch, embeds):
    model, spec = _model(arch), SPECS[cache]
    dynamic = _continue(model, REFERENCE, embeds, None)
    long, continued = _continue(model, spec, embeds, None), _continue(model, spec, embeds, 3)
    prompt_len = 0 if embeds else 12
    assert_same_tokens(dynamic, continued, spec, prompt_len)
    assert torch.equal(long.sequences, continued.sequences)
    assert_same_cache(long.past_key_values, continued.past_key_values, ATOL[cache])
    if torch.equal(dynamic.sequences, continued.sequences):
        assert_same_cache(dynamic.past_key_values, continued.past_key_values, ATOL[cache])


class _Pair:
    """One of our caches and a `DynamicCache(config=...)` fed the same forwards and the same method calls."""

    def __init__(self, model: PreTrainedModel, cache: str):
        self.model, self.atol = model, ATOL[cache]
        self.ours, self.reference = _factories()[cache](model), DynamicCache(config=model.config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run `ids` through both; assert equal logits and caches; return the reference's next greedy tokens."""
        for q_len in (1, ids.shape[1]):
            for index in range(len(self.reference.layers)):
                want = self.reference.get_mask_sizes(q_len, index)
                assert self.ours.get_mask_sizes(q_len, index) == want, f"get_mask_sizes({q_len}, {index})"
        with torch.no_grad():
            want = self.model(input_ids=ids, past_key_values=self.reference).logits
            have = self.model(input_ids=ids, past_key_values=self.ours).logits
        torch.testing.assert_close(have, want, atol=max(self.atol, 1e-5), rtol=0)
        self.check()
        return want[:, -1:].argmax(-1)

    def call(self, method: str, *args) -> None:
        getattr(self.reference, method)(*args)
        getattr(self.ours, method)(*args)
        self.check()

    def check(self) -> None:
        assert_same_cache(self.reference, self.ours, self.atol)
        assert self.ours.is_sliding == self.reference.is_sliding
        assert self.ours.is_initialized == self.reference.is_initialized
        assert [self.ours.get_max_length(i) for i in range(len(self.ours))] == [
            self.reference.get_max_length(i) for i in range(len(self.reference))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", SPECS)
def test_batch_methods_match_dynamic_cache(cache, arch):
    pair = _Pair(_model(arch), cache)
    ids = make_prompts([12, 12], seed=23)["input_ids"]
    token = pair.forward(ids)
    token = pair.forward(token)
    pair.call("batch_repeat_interleave", 2)
    token = pair.forward(token.repeat_interleave(2, dim=0))
    pair.call("batch_select_indices", torch.tensor([0, 3]))
    token = pair.forward(token[[0, 3]])
    pair.call("reorder_cache", torch.tensor([1, 0]))
    pair.forward(token[[1, 0]])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", SPECS)
def test_crop_matches_dynamic_cache(cache, arch):
    pair = _Pair(_model(arch), cache)
    pair.call("activate_past_recording")  # as assisted decoding does: sliding layers may then be cropped
    ids = make_prompts([12, 12], seed=24)["input_ids"]
    token = pair.forward(ids)
    pair.forward(torch.cat([token, ids[:, :2]], dim=1))  # three "candidates", two of them rejected
    pair.call("crop", -2)
    token = pair.forward(token)
    pair.call("crop", 0)
    pair.forward(token)


def _compiled_logits(model: PreTrainedModel, make_cache: Callable[[PreTrainedModel], Cache]) -> None:
    """Prefill and one decode step, eager and `torch.compile`-d, each over a fresh cache: equal logits."""
    ids = make_prompts([12, 12], seed=25)["input_ids"]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    eager_cache, compiled_cache = make_cache(model), make_cache(model)
    with torch.no_grad():
        for step in range(2):
            want = model(input_ids=ids, past_key_values=eager_cache).logits
            have = compiled(input_ids=ids, past_key_values=compiled_cache).logits
            torch.testing.assert_close(have, want)
            ids = want[:, -1:].argmax(-1)
    assert_same_cache(eager_cache, compiled_cache, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", *SPECS])
def test_compiled_forward_equals_eager(cache):
    make = (lambda model: DynamicCache(config=model.config)) if cache == "dynamic" else _factories()[cache]
    _compiled_logits(_model("mistral"), make)
