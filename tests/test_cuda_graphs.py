"""CUDA graphs of decode steps: their attention (`decode_attention`: fixed shapes, no host synchronisation) equals the
kernel and the gather path on CPU; the padded batch sizes; the pool's spare block. On a GPU (skipped elsewhere): an
engine replays graphs for its decode steps and its greedy tokens equal sequential `generate`."""

import pytest
import torch

from conformance import make_model
from engine_helpers import assert_greedy_equal, greedy_reference, random_prompts
from hf_accel import Engine, EngineConfig, SamplingParams
from hf_accel.cache.kv_shape import KVShape
from hf_accel.runtime.attention import gathered_attention
from hf_accel.runtime.cuda_graphs import decode_attention, graph_sizes
from hf_accel.runtime.kv_pool import KVPool
from hf_accel.kernels.custom_ops import paged_attention_kernel
from test_paged_kernel import run, step_inputs


@pytest.mark.parametrize("window, softcap", [(0, 0.0), (6, 0.0), (0, 30.0)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("num", [1, 4])  # queries per sequence: a decode step, a verify of 1 + 3 candidates
def test_decode_attention_equals_the_gather_path_and_the_kernel(window, softcap, heads, kv_heads, num):
    # block tables padded past each sequence's blocks, as a captured step's are
    inputs = step_inputs(torch.float32, heads, kv_heads, [num] * 5, [num, 9, 17, 4, 30], dim=64, block_size=16)
    got, got_keys, got_values = run(decode_attention, inputs, window, softcap)
    expected, keys, values = run(gathered_attention, inputs, window, softcap)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    kernel = paged_attention_kernel()
    if kernel is not None:
        torch.testing.assert_close(got, run(kernel, inputs, window, softcap)[0], atol=2e-6, rtol=2e-6)


def test_graph_sizes_cover_every_batch_up_to_max_num_seqs():
    assert graph_sizes(1) == [1]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 50]


def test_compiled_generate_captures_its_own_graphs_for_the_modes_that_ask_for_cuda_graphs():
    from hf_accel.compiled.captured_step import captures
    from hf_accel.compiled.step import inductor_mode

    assert [inductor_mode(m) for m in ("reduce-overhead", "max-autotune", "default", None)] == [
        "default", "max-autotune-no-cudagraphs", "default", None]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert captures(cuda, "reduce-overhead") and captures(cuda, "max-autotune") and not captures(cuda, "default")
    assert not captures(cpu, "reduce-overhead")


def test_the_spare_block_lies_past_the_allocators_blocks():
    shape = KVShape(num_layers=2, kv_heads=2, head_dim=8)
    plain = KVPool(shape, 10, 4, torch.float32, torch.device("cpu"))
    spare = KVPool(shape, 10, 4, torch.float32, torch.device("cpu"), spare_block=True)
    assert plain.spare_block is None and spare.spare_block == 10 and spare.num_blocks == 10
    assert spare.keys[0].shape[1] == 11 and spare.nbytes == plain.nbytes * 11 // 10


@pytest.mark.gpu
@pytest.mark.compiled  # the default engine: graphs on, not the eager one other tests get
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_replays_decode_graphs_on_cuda():
    model = make_model("llama", torch.float32, "sdpa").cuda()
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, block_size=4))
    graphs = engine.core.runner.forward.graphs
    assert graphs is not None and set(graphs.graphs) == set(graph_sizes(4))
    replays = []
    run_graph = graphs.run
    graphs.run = lambda *args: replays.append(1) or run_graph(*args)
    prompts = random_prompts([5, 17, 30, 9], seed=4)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert replays
    for prompt, out in zip(prompts, outputs):
        assert_greedy_equal(model, prompt, out.outputs[0].token_ids, greedy_reference(model, prompt, 16))


@pytest.mark.gpu
@pytest.mark.compiled
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_generate_replays_one_captured_graph_on_cuda(monkeypatch):
    from transformers import CompileConfig

    from hf_accel.compiled import captured_step

    model = make_model("llama", torch.float32, "sdpa").cuda()
    replays = []
    replay = captured_step.CapturedStep.__call__
    monkeypatch.setattr(captured_step.CapturedStep, "__call__", lambda *args: replays.append(1) or replay(*args))
    inputs = {"input_ids": torch.randint(3, 100, (3, 12), device="cuda")}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    expected = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False, cache_implementation="paged",
                         compile_config=CompileConfig())
    assert torch.equal(out, expected) and len(replays) == 15  # every token after the prefill's


@pytest.mark.gpu
@pytest.mark.compiled
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("capture_at", [1, 3])  # every shape at its first call; the default
@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_compiled_speculation_replays_captured_graphs_on_cuda(monkeypatch, method, capture_at):
    from transformers import CompileConfig

    from hf_accel import EagleHead, draft_generate, eagle_generate, ngram_generate
    from hf_accel.compiled import captured_step

    model = make_model("llama", torch.float32, "sdpa").cuda()
    built, replays = [], []
    init, replay = captured_step.CapturedStep.__init__, captured_step.CapturedStep.__call__
    monkeypatch.setattr(captured_step.CapturedStep, "__init__",
                        lambda self, step, *inputs: built.append(tuple(inputs[0].shape)) or init(self, step, *inputs))
    monkeypatch.setattr(captured_step.CapturedStep, "__call__", lambda *args: replays.append(1) or replay(*args))
    monkeypatch.setattr(captured_step, "CAPTURE_AT", capture_at)
    motif = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(7))
    inputs = {"input_ids": motif.repeat(2, 4).cuda()}  # repeating prompts: prompt lookup finds matches
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    expected = model.generate(**inputs, max_new_tokens=48, do_sample=False)
    speculative = {"ngram": {"custom_generate": ngram_generate, "draft_token_cost": 0.0},
                   "draft": {"custom_generate": draft_generate, "draft_model": model},
                   "eagle": {"custom_generate": eagle_generate, "eagle_head": EagleHead.for_model(model).cuda(),
                             "min_draft_probability": 0.0}}[method]
    out = model.generate(**inputs, max_new_tokens=48, do_sample=False, compile_config=CompileConfig(), **speculative)
    assert torch.equal(out, expected)
    assert built and len(replays) > len(built)
    if capture_at == 1:
        assert any(len(shape) == 2 and shape[1] > 2 for shape in built)  # a target verify of 1 + k, k > 1
