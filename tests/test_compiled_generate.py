"""Compiled generate: `compile_config` with `cache_implementation="paged"` (or "sink") runs hf_accel's compiled decode loop (a
static paged pool attended in place, one whole-step graph per token) on CPU too. Greedy tokens equal eager
`DynamicCache`'s on Llama (grouped-query), Mistral (every layer sliding) and Gemma 2 (hybrid, soft-capping), batch 1
and left-padded batches; no recompilation across tokens or across calls with other prompt and output lengths;
sampling warpers run inside the graph; other processors, scores, EOS padding and streamers as transformers has them;
uncovered modes fall back to transformers' loop. The sink cache compiles too (its window and re-rotated sinks over
a ring of blocks, tokens equal to eager `SinkCache`'s); the quantized cache's loop is tested in
test_compiled_quantized.py."""

import copy
import logging

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig, DynamicCache
from transformers.generation.streamers import BaseStreamer

from conformance import PAD, make_model, make_prompts, weights_packed_while
from hf_accel import OutOfBlocksError
from hf_accel.cache.kv_shape import KVShape
from hf_accel.compiled.decode_loop import compiled_generate
from hf_accel.compiled.paged_rows import PagedRows
from hf_accel.compiled.step import compile_context, compiled_verify_step
from hf_accel.runtime.attention import ATTENTION_NAME, gathered_attention
from hf_accel.runtime.kv_pool import KVPool
from hf_accel.kernels.custom_ops import paged_attention_kernel
from hf_accel.registry import attention_implementation
from hf_accel.compiled.route import route_generate

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)


def unique_graphs() -> int:
    return dynamo_utils.counters["stats"]["unique_graphs"]


def run(model, inputs, compiled: bool, **kwargs):
    extra = {"cache_implementation": "paged", "compile_config": COMPILE} if compiled else {}
    kwargs.setdefault("max_new_tokens", 12)
    kwargs.setdefault("do_sample", False)
    return model.generate(**inputs, pad_token_id=PAD, **extra, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_greedy_equals_dynamic_cache_batch_one_and_padded(arch):
    model = make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")
    for lengths in ([9], [5, 23, 14]):  # Mistral's window is shorter than prompt + output
        inputs = make_prompts(lengths, seed=len(lengths))
        expected = run(model, inputs, compiled=False, max_new_tokens=20)
        assert torch.equal(run(model, inputs, compiled=True, max_new_tokens=20), expected), (arch, lengths)


def test_no_recompilation_across_tokens_and_calls():
    model = make_model("llama", torch.float32, "sdpa")
    run(model, make_prompts([6, 11]), compiled=True, max_new_tokens=3)  # traces the batch > 1 graph
    before = unique_graphs()
    for lengths, new in (([4, 30, 9], 40), ([17, 2], 7), ([3, 3, 3, 3, 3], 25)):
        inputs = make_prompts(lengths, seed=new)
        assert torch.equal(run(model, inputs, compiled=True, max_new_tokens=new),
                           run(model, inputs, compiled=False, max_new_tokens=new))
    assert unique_graphs() == before  # rows, block-table width and positions are symbols of one graph


class DynamoRestarts(logging.Handler):
    """Counts dynamo's "Restarting analysis" records (a graph traced and lowered again from scratch)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Restarting analysis"):
            self.reasons.append(record.getMessage())


@pytest.fixture
def dynamo_restarts():
    logger = logging.getLogger("torch._dynamo.convert_frame")
    handler, level = DynamoRestarts(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_each_greedy_graph_is_traced_once(dynamo_restarts):
    # module floats (an attention's `scaling`, passed to the paged op) traced as symbols made dynamo restart every
    # compile: each graph traced and lowered twice
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([6, 11])
    assert torch.equal(run(model, inputs, compiled=True, max_new_tokens=4),
                       run(model, inputs, compiled=False, max_new_tokens=4))
    assert dynamo_restarts.reasons == []


def test_another_temperature_reuses_the_sampled_graph():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([5, 9], seed=2)
    run(model, inputs, compiled=True, max_new_tokens=4, do_sample=True, top_k=0, temperature=0.7)
    before = unique_graphs()
    run(model, inputs, compiled=True, max_new_tokens=4, do_sample=True, top_k=0, temperature=1.3)
    assert unique_graphs() == before  # sampled loops keep the warpers' floats symbolic


def test_the_compiled_loop_really_runs_and_returns_its_own_output(monkeypatch):
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([7, 3])
    kwargs = {"cache_implementation": "paged", "compile_config": COMPILE}
    route_generate(model, kwargs)
    assert kwargs["custom_generate"] is compiled_generate
    out = run(model, inputs, compiled=True, return_dict_in_generate=True)
    assert out.past_key_values is None  # the static pool lives for the call only (a PagedCache would be returned)


def test_sampling_with_top_k_one_is_greedy_and_sampling_varies():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([8, 4], seed=3)
    greedy = run(model, inputs, compiled=False, max_new_tokens=15)
    sampled = run(model, inputs, compiled=True, max_new_tokens=15, do_sample=True, top_k=1, temperature=0.7)
    assert torch.equal(sampled, greedy)  # temperature and top-k applied in the graph, in transformers' order
    torch.manual_seed(0)
    draws = {tuple(run(model, inputs, compiled=True, max_new_tokens=15, do_sample=True, top_k=0, top_p=0.99,
                       temperature=1.5)[0].tolist()) for _ in range(4)}
    assert len(draws) > 1


def test_host_processors_scores_and_eos_match_transformers():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([10, 6], seed=4)
    free = run(model, inputs, compiled=False, max_new_tokens=16)
    eos = int(free[1, -8])  # a token row 1 emits mid-way: it stops there and is padded after
    kwargs = dict(max_new_tokens=16, repetition_penalty=1.3, eos_token_id=eos, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    expected, got = run(model, inputs, compiled=False, **kwargs), run(model, inputs, compiled=True, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) and len(got.logits) == len(expected.logits)
    for mine, theirs in zip(got.scores + got.logits, expected.scores + expected.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_the_prompt_then_each_token():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([6])
    streamer = Collect()
    out = run(model, inputs, compiled=True, streamer=streamer)
    assert streamer.ended and [t for chunk in streamer.chunks for t in chunk] == out[0].tolist()


def test_beam_search_falls_back_to_the_eager_loop_with_a_warning():
    model = make_model("llama", torch.float32, "sdpa")
    inputs = make_prompts([6, 9])
    with pytest.warns(UserWarning, match="compile_config is not applied"):
        got = run(model, inputs, compiled=True, num_beams=2)
    assert torch.equal(got, run(model, inputs, compiled=False, num_beams=2))


SINK = {"cache_implementation": "sink", "cache_config": {"window_length": 12, "num_sink_tokens": 3}}


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_sink_cache_compiled_equals_eager_sink_cache(arch):
    # window 12 with 3 sinks, prompts shorter and longer than the window, 30 new tokens: rows fill the window at
    # different steps, then read their re-rotated sinks; Gemma 2's sliding layers keep their own window, no sinks
    model = make_model(arch, torch.float32, "eager" if arch == "gemma2" else "sdpa")
    differs_from_dynamic = False
    for lengths in ([9], [5, 23, 14]):
        inputs = make_prompts(lengths, seed=len(lengths))
        expected = run(model, inputs, compiled=False, max_new_tokens=30, **SINK)
        got = model.generate(**inputs, max_new_tokens=30, do_sample=False, pad_token_id=PAD, compile_config=COMPILE,
                             **SINK)
        assert torch.equal(got, expected), (arch, lengths)
        differs_from_dynamic |= not torch.equal(got, run(model, inputs, compiled=False, max_new_tokens=30))
    assert differs_from_dynamic  # the window and sinks were in effect


def test_sink_ring_memory_does_not_grow_with_the_output():
    model = make_model("llama", torch.float32, "sdpa")
    sizes = [PagedRows(model, [10, 4], 10 + new, 16, ring_tokens=13).kv.nbytes for new in (20, 200, 2000)]
    assert sizes[0] == sizes[1] == sizes[2]
    assert PagedRows(model, [10, 4], 2010, 16).kv.nbytes > 10 * sizes[0]


def test_fixed_pool_too_small_raises_and_a_passed_cache_is_left_alone():
    model = make_model("llama", torch.float32, "sdpa")
    with pytest.raises(OutOfBlocksError):
        run(model, make_prompts([6, 6]), compiled=True, max_new_tokens=40, cache_config={"num_blocks": 3})
    kwargs = {"cache_implementation": "paged", "compile_config": COMPILE, "past_key_values": DynamicCache()}
    route_generate(model, kwargs)
    assert "custom_generate" not in kwargs



def test_verify_step_gives_the_greedy_token_after_each_candidate_and_rolls_back_in_place():
    model = make_model("llama", torch.float32, "sdpa")
    rows = PagedRows(model, [7, 12], 30, 4)
    prompts = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    verify = compiled_verify_step(COMPILE, model)
    attend = paged_attention_kernel() or gathered_attention
    rounds = [torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    with torch.no_grad(), attention_implementation(model, ATTENTION_NAME), \
            compile_context(rows.device, COMPILE, model.dtype):
        inputs = rows.prefill(prompts, attend)
        model(input_ids=inputs.tokens, position_ids=inputs.positions, use_cache=False, hf_accel_step=inputs.attention)
        # the second round starts at the same positions: it overwrites the first one's K/V
        got = [verify(model, candidates, rows.prompt_lengths, rows.kv, rows.block_table, attend)
               for candidates in rounds]
    with torch.no_grad():
        for verified, candidates in zip(got, rounds):
            for row, prompt in enumerate(prompts):
                full = torch.cat([prompt, candidates[row]])[None]
                assert torch.equal(verified[row], model(full).logits[0, len(prompt) :].argmax(-1))


def test_dynamo_limits_reached_elsewhere_do_not_stop_compiled_generate():
    # a long notebook or test session can exhaust dynamo's default limits; past them, dynamo compiles nothing and
    # a fullgraph compile raises: compiled generate (and the engine's warm-up) raise both limits while they compile
    model = make_model("llama", torch.float32, "sdpa")
    with torch._dynamo.config.patch(accumulated_recompile_limit=1, recompile_limit=1):
        for lengths in ([5], [4, 6], [3, 8, 2]):
            inputs = make_prompts(lengths, seed=7)
            assert torch.equal(run(model, inputs, compiled=True), run(model, inputs, compiled=False))


def test_graphs_freeze_packed_weights_and_changed_weights_get_new_graphs():
    # on CPU the graphs hold each Linear's weight packed (inductor's freezing, hf_accel's panels); a fine-tune step, a loaded
    # state dict or any in-place change between calls must reach the next call
    model = copy.deepcopy(make_model("llama", torch.float32, "sdpa"))  # its weights change: not the shared one
    inputs = make_prompts([6, 11], seed=3)
    before, packed = weights_packed_while(lambda: run(model, inputs, compiled=True))
    assert packed > 0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-1.5)
    after = run(model, inputs, compiled=False)
    assert not torch.equal(after, before)  # the change matters to the tokens
    assert torch.equal(run(model, inputs, compiled=True), after)
    model.load_state_dict({name: -tensor for name, tensor in model.state_dict().items()})
    assert torch.equal(run(model, inputs, compiled=True), run(model, inputs, compiled=False))


def test_freezing_false_in_the_options_compiles_the_weights_as_inputs():
    model = copy.deepcopy(make_model("llama", torch.float32, "sdpa"))  # its weights change: not the shared one
    inputs = make_prompts([5, 9], seed=4)
    unfrozen = CompileConfig(fullgraph=True, options={"freezing": False})
    out, packed = weights_packed_while(lambda: model.generate(
        **inputs, pad_token_id=PAD, max_new_tokens=12, do_sample=False, cache_implementation="paged",
        compile_config=unfrozen))
    assert packed == 0
    assert torch.equal(out, run(model, inputs, compiled=False))


def test_pool_sizes_fixed_by_the_model_are_static_in_a_dynamic_graph():
    # kv_heads, block_size and head_dim each got a symbol of their own under dynamic=True (a third of the sink
    # step's compile time went to proving reshapes over them); only the number of blocks varies between pools
    seen = []

    def backend(graph, example_inputs):
        values = [node.meta.get("example_value") for node in graph.graph.nodes if node.op == "placeholder"]
        seen.extend(tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and v.dim() == 4)  # fake tensors
        return graph.forward

    pool = KVPool(KVShape(num_layers=1, kv_heads=2, head_dim=8), num_blocks=5, block_size=4, dtype=torch.float32,
                  device=torch.device("cpu"))
    torch.compile(lambda keys: keys * 2, backend=backend, dynamic=True, fullgraph=True)(pool.keys[0])
    ((heads, blocks, block_size, head_dim),) = seen
    assert (heads, block_size, head_dim) == (2, 4, 8) and all(type(s) is int for s in (heads, block_size, head_dim))
    assert isinstance(blocks, torch.SymInt)


def test_host_processing_calls_the_processors_in_order_as_the_list_does():
    from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from hf_accel.compiled.token_choice import host_processing

    class Shift(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores * 2 + input_ids.shape[1]

    class WantsMore(LogitsProcessor):
        def __call__(self, input_ids, scores, cur_len):
            return scores

    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), Shift()])
    input_ids, scores = torch.tensor([[1, 2, 3]]), torch.randn(1, 8)
    assert torch.equal(host_processing(processors)(input_ids, scores.clone()), processors(input_ids, scores.clone()))
    odd = LogitsProcessorList([Shift(), WantsMore()])
    assert host_processing(odd) is odd  # the list's own call, which names the missing argument
    with pytest.raises(ValueError, match="cur_len"):
        host_processing(odd)(input_ids, scores)
