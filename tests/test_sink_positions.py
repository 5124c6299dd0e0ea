"""Beyond the window: SinkCache's attention equals StreamingLLM's, recomputed independently.

In a 1-layer model the cached K/V of a token depend only on the token and its position, so what the sink cache
attends to can be recomputed from scratch: the row's kept tokens (its first S real tokens + the last N - S before the
query, or all of them while they fit in N) followed by the query, at StreamingLLM's in-cache positions 0, 1, 2, ...
with no cache at all. The logits of every generated step must match, for left-padded batches, prompts longer than the
window, and several RoPE variants (partial rotary, yarn's attention scaling, per-layer-type parameters, k-norm).
"""

import pytest
import torch
import transformers

import hf_accel
from conformance import _COMMON, VOCAB_SIZE, make_prompts

ONE_LAYER = {**_COMMON, "num_hidden_layers": 1}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**ONE_LAYER),
    "llama-yarn": lambda: transformers.LlamaConfig(**ONE_LAYER, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear": lambda: transformers.LlamaConfig(**ONE_LAYER, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "phi3-partial": lambda: transformers.Phi3Config(**{k: v for k, v in ONE_LAYER.items() if k != "head_dim"},
                                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.5}),
    "qwen3": lambda: transformers.Qwen3Config(**ONE_LAYER),
    "gemma3": lambda: transformers.Gemma3TextConfig(**ONE_LAYER, layer_types=["full_attention"], sliding_window=8,
                                                    query_pre_attn_scalar=16),
}


def one_layer_model(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


def kept_tokens(before: list[int], window_length: int, num_sinks: int) -> list[int]:
    """StreamingLLM's cache for one row: every real token while they fit, else the first S + the last N - S."""
    if len(before) <= window_length:
        return before
    return before[:num_sinks] + before[len(before) - (window_length - num_sinks):]


@torch.no_grad()
def reference_logits(model, prompt: list[int], generated: list[int], step: int, window: int, sinks: int):
    """Next-token logits at generated step `step`: the prompt alone at step 0 (prefill attends to all of it), else
    the kept tokens + the query, recomputed without a cache at positions 0 .. len - 1."""
    if step == 0:
        tokens = prompt
    else:
        tokens = kept_tokens(prompt + generated[: step - 1], window, sinks) + [generated[step - 1]]
    ids = torch.tensor([tokens])
    return model(input_ids=ids, position_ids=torch.arange(len(tokens))[None], use_cache=False).logits[0, -1]


def check_against_reference(model, lengths, window, sinks, new_tokens=24, **generate_kwargs):
    inputs = make_prompts(lengths, seed=3)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                             cache_implementation="sink",
                             cache_config={"window_length": window, "num_sink_tokens": sinks}, **generate_kwargs)
    assert type(out.past_key_values) is hf_accel.SinkCache
    width = inputs["input_ids"].shape[1]
    for row, length in enumerate(lengths):
        prompt = inputs["input_ids"][row, width - length:].tolist()
        generated = out.sequences[row, width:].tolist()
        for step in range(new_tokens):
            expected = reference_logits(model, prompt, generated, step, window, sinks)
            got = out.logits[step][row]
            assert torch.allclose(got, expected, atol=2e-4), (
                f"row {row} (prompt {length}), step {step}: max |diff| {(got - expected).abs().max():.3g}")



@pytest.mark.parametrize("name", list(CONFIGS))
def test_sinks_match_streaming_llm_recomputation(name):
    # rows: longer than the window from the prompt on, crossing it while generating, and mostly padding
    check_against_reference(one_layer_model(name), lengths=[13, 6, 2], window=8, sinks=2)


def test_plain_window_matches_recomputation():
    check_against_reference(one_layer_model("llama"), lengths=[11, 4], window=6, sinks=0)


def test_many_sinks_and_prompt_longer_than_the_buffer():
    # 100-token prompt > window + slack (8 + 64 slots): the prefill is returned whole and only the tail is kept
    check_against_reference(one_layer_model("llama"), lengths=[100, 3], window=8, sinks=4, new_tokens=80)


def test_the_reference_notices_wrong_sink_positions():
    """The check can fail: sinks left at their original positions (no re-rotation) do not match."""
    model = one_layer_model("llama")
    original = hf_accel.cache.sink.rotate
    try:
        hf_accel.cache.sink.rotate = lambda keys, cos, sin: keys
        with pytest.raises(AssertionError, match="max \\|diff\\|"):
            check_against_reference(model, lengths=[13], window=8, sinks=2)
    finally:
        hf_accel.cache.sink.rotate = original


def test_generation_past_max_position_embeddings_stays_finite():
    config = transformers.LlamaConfig(**{**_COMMON, "max_position_embeddings": 64})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    inputs = make_prompts([10, 4], seed=5)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=200, min_new_tokens=200, do_sample=True, pad_token_id=0,
                             eos_token_id=None, return_dict_in_generate=True, output_logits=True,
                             cache_implementation="sink", cache_config={"window_length": 16, "num_sink_tokens": 4})
    assert out.sequences.shape == (2, 210)
    assert all(torch.isfinite(logits).all() for logits in out.logits)
    assert int(out.sequences.max()) < VOCAB_SIZE
