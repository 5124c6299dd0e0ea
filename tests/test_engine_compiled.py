"""The engine's compiled model step (the default; tests elsewhere run eagerly): greedy tokens equal the eager engine's
and sequential `generate` on Llama (grouped-query), Mistral (every layer sliding) and Gemma 2 (soft-capping), with
prefill chunks and decodes in the same steps; exactly two graphs (several tokens, and the static one of one token),
both compiled at start, and no recompilation however the step's sizes change; the hooks a
model has when its graphs compile are the graphs' own; `enforce_eager` and the fallback where compiling fails."""

import copy

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from conformance import make_model, weights_packed_while
from engine_helpers import assert_greedy_equal, greedy_reference, random_prompts
from hf_accel import (Engine, EngineConfig, MedusaHeads, SamplingParams, SpeculativeConfig, WeightOnlyConfig, bench,
                      quantize_model)
from hf_accel.kernels.custom_ops import paged_attention_kernel
from hf_accel.runtime.step_inputs import StepInputs

pytestmark = [pytest.mark.compiled,
              pytest.mark.skipif(paged_attention_kernel() is None, reason="the paged attention kernel is not built")]

# ragged prompts, one longer than a prefill chunk (max_num_batched_tokens below), so chunks and decodes share steps
LENGTHS = [5, 70, 17, 1, 33, 9]
MAX_TOKENS = [12, 3, 20, 9, 1, 16]


def unique_graphs() -> int:
    """Graphs dynamo traced, and engine steps loaded whole from disk instead (`runtime/saved_steps.py`)."""
    return dynamo_utils.counters["stats"]["unique_graphs"] + dynamo_utils.counters["hf_accel"]["saved_steps_loaded"]


def run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS[: len(prompts)]]
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_compiled_engine_equals_eager_and_generate_without_recompiling(arch):
    model = make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")
    prompts = random_prompts(LENGTHS, seed=2)
    before = unique_graphs()
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4))
    assert engine.core.runner.forward.compiled and engine.stats().compile_seconds > 0
    # several tokens; one token (a sequence decoding alone, or a prompt of one token), static: both at start
    assert unique_graphs() - before == 2
    compiled = run(engine, prompts) + run(engine, prompts[:1])  # also a step of one sequence prefilling alone
    assert unique_graphs() - before == 2  # sizes changed every step; nothing recompiled
    # a one-token step that keeps no row (a prompt's chunk of one token mid-prompt) runs the single-sequence graph
    out = engine.core.runner.forward(StepInputs(tokens=[7], positions=[0], slots=[0], query_start=[0, 1],
                                                kv_lengths=[1], tables=[[0]]))
    assert out.logits.shape[0] == 0 and unique_graphs() - before == 2
    eager = run(Engine(model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                                                  enforce_eager=True)), prompts)
    for prompt, n, got, expected in zip(prompts, MAX_TOKENS, compiled, eager):
        assert_greedy_equal(model, prompt, got, expected)  # inductor's fused kernels round differently: ties only
        assert_greedy_equal(model, prompt, got, greedy_reference(model, prompt, n))


def test_graphs_hold_the_hooks_the_model_had_when_they_compiled():
    """An engine's graphs carry no guards on module hooks (half a millisecond a step): the hooks are part of their
    key. A hook added to the model later is not run by the first engine's graphs (as a weight changed later is not),
    and an engine built after it compiles graphs of its own that run it."""
    model = copy.deepcopy(make_model("llama", torch.float32, "sdpa"))  # make_model's are shared: keep those clean
    prompts = random_prompts(LENGTHS[:3], seed=4)
    config = EngineConfig(max_num_seqs=4, block_size=4)
    first = Engine(model, config=config)
    before = run(first, prompts)
    forced = 7  # a hook that makes the model always write this token
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out.index_fill(-1, torch.tensor([forced]),
                                                                                          1e4))
    try:
        graphs = unique_graphs()
        assert run(first, prompts) == before and unique_graphs() == graphs  # its graphs, unchanged
        second = Engine(model, config=config)
        assert unique_graphs() > graphs and second.core.runner.forward.compiled
        assert all(tokens == [forced] * len(tokens) for tokens in run(second, prompts))
        assert run(first, prompts) == before  # still its own graphs
    finally:
        handle.remove()


def test_medusa_engine_runs_eagerly_and_equals_generate():
    # its step returns hidden states, captured by transformers with a context manager dynamo cannot trace
    model = make_model("llama", torch.float32, "sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(3)
        heads = MedusaHeads.for_model(model, num_heads=3, init_from_lm_head=True).eval()
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, block_size=4),
                    speculative=SpeculativeConfig("medusa", model=heads))
    assert not engine.core.runner.forward.compiled
    prompts = random_prompts(LENGTHS, seed=5)
    outputs = run(engine, prompts)
    assert engine.stats().spec_decode_num_drafts > 0
    for prompt, n, got in zip(prompts, MAX_TOKENS, outputs):
        assert_greedy_equal(model, prompt, got, greedy_reference(model, prompt, n))


def test_enforce_eager_compiles_nothing():
    before = unique_graphs()
    engine = Engine(make_model("llama", torch.float32, "sdpa"), config=EngineConfig(enforce_eager=True))
    assert not engine.core.runner.forward.compiled and engine.stats().compile_seconds == 0.0
    run(engine, random_prompts(LENGTHS[:2]))
    assert unique_graphs() == before
    with pytest.raises(TypeError, match="enforce_eager"):
        Engine(make_model("llama", torch.float32, "sdpa"), config=EngineConfig(enforce_eager="yes"))


def test_a_model_that_cannot_compile_runs_eagerly_with_a_warning():
    model = copy.deepcopy(make_model("llama", torch.float32, "sdpa"))  # make_model's are shared: keep those clean
    # a hook that breaks the graph: nothing in eager mode, an error for the engine's full-graph compile
    model.model.layers[0].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    with pytest.warns(RuntimeWarning, match="compiling the engine's model step failed"):
        engine = Engine(model, config=EngineConfig(block_size=4))
    assert not engine.core.runner.forward.compiled
    prompts = random_prompts(LENGTHS[:3], seed=1)
    got = run(engine, prompts)
    for prompt, n, tokens in zip(prompts, MAX_TOKENS, got):
        assert_greedy_equal(model, prompt, tokens, greedy_reference(model, prompt, n))


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_quantized_models_compile_and_decode_as_plain_greedy(bits):
    model = quantize_model(make_model("llama", torch.float32, "sdpa"),
                           WeightOnlyConfig(bits=bits, group_size=32 if bits == 4 else None), progress=False)
    engine = Engine(model, config=EngineConfig(block_size=4))
    assert engine.core.runner.forward.compiled
    prompts = random_prompts(LENGTHS[:3], seed=bits)
    for prompt, n, tokens in zip(prompts, MAX_TOKENS, run(engine, prompts)):
        assert_greedy_equal(model, prompt, tokens, greedy_reference(model, prompt, n))


def test_padding_keeps_sizes_off_one_and_changes_nothing_real():
    inputs = StepInputs(tokens=[7], positions=[4], slots=[9], query_start=[0, 1], kv_lengths=[5], tables=[[2]],
                        keep=[0])
    padded = inputs.padded()
    assert padded.query_start == [0, 1, 1] and padded.kv_lengths == [5, 0]  # an empty sequence: no queries, no context
    assert padded.tables == [[2, 0], [0, 0]] and padded.keep == [0, 0]
    assert (padded.tokens, padded.positions, padded.slots) == (inputs.tokens, inputs.positions, inputs.slots)
    assert StepInputs().padded().keep == [0, 0]  # a step that samples nothing (a prefill chunk mid-prompt)


def test_many_engines_in_one_process_all_compile():
    # dynamo's cache is per model class, shared by every engine: past its default limit of 8 graphs (models of 6
    # vocabulary sizes, 2 graphs each) they would stop compiling
    engines = [Engine(bench.random_llama(hidden_size=32, num_layers=1, vocab_size=256 + 32 * i),
                      config=EngineConfig(block_size=4)) for i in range(6)]
    assert all(engine.core.runner.forward.compiled for engine in engines)


def test_the_compiled_engine_packs_its_weights_and_a_new_engine_sees_changed_ones():
    # the engine's graphs pack each Linear's weight when the engine is built (a copy); weights changed
    # in place afterwards need a new engine, which must not reuse the first one's graph
    model = copy.deepcopy(make_model("llama", torch.float32, "sdpa"))  # its weights change: not the shared one
    prompts = random_prompts(LENGTHS[:3], seed=7)
    before, packed = weights_packed_while(
        lambda: run(Engine(model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4)),
                    prompts))
    assert packed > 0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1.5)
    after = [greedy_reference(model, prompt, n) for prompt, n in zip(prompts, MAX_TOKENS)]
    assert after != before  # the change matters to the tokens
    rebuilt = run(Engine(model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4)), prompts)
    for prompt, got, expected in zip(prompts, rebuilt, after):
        assert_greedy_equal(model, prompt, got, expected)
