"""`EngineConfig(compile_in_background=True)`: the engine serves eagerly from its first step while its graphs compile
in a thread, then switches to them; tokens equal plain greedy before, during and after the switch; the compile's
writes land in the spare block only (no request's K/V is touched); in an engine-core process the idle loop reports
the end of the compile; the shared attention switch survives two threads entering and leaving in any order."""

import threading
import time
import warnings

import pytest
import torch

from conformance import make_model
from engine_helpers import assert_greedy_equal, greedy_reference, random_prompts
from hf_accel import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from hf_accel.kernels.custom_ops import paged_attention_kernel
from hf_accel.registry import attention_implementation
from hf_accel.cache.kv_shape import KVShape
from hf_accel.runtime.attention import ATTENTION_NAME
from hf_accel.runtime.kv_pool import KVPool
from hf_accel.runtime.step_forward import StepForward

LENGTHS = [5, 40, 17, 1]
MAX_TOKENS = [12, 3, 20, 9]
COMPILE_TIMEOUT = 300.0


def run(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS[: len(prompts)]]
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]


def wait_compiled(engine) -> None:
    deadline = time.monotonic() + COMPILE_TIMEOUT
    while engine.compiling:
        assert time.monotonic() < deadline, "the background compile did not end"
        time.sleep(0.05)


@pytest.mark.compiled
@pytest.mark.skipif(paged_attention_kernel() is None, reason="the paged attention kernel is not built")
def test_engine_serves_while_compiling_then_switches_to_the_graphs():
    model = make_model("llama", torch.float32, "sdpa")
    prompts = random_prompts(LENGTHS, seed=4)
    engine = Engine(model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                                               compile_in_background=True))
    forward = engine.core.runner.forward
    assert engine.core.kv.spare_block == engine.core.blocks.num_blocks  # the compile's scratch, never handed out
    assert not forward.compiled  # eager until the graphs are ready
    during = run(engine, prompts)  # served while the thread compiles (or just after: both must be right)
    wait_compiled(engine)
    assert engine.stats().compile_seconds > 0 and not engine.stats().compiling
    after = run(engine, prompts)
    assert forward.compiled and forward._warm  # the first step after the compile switched
    for prompt, n, first, second in zip(prompts, MAX_TOKENS, during, after):
        expected = greedy_reference(model, prompt, n)
        assert_greedy_equal(model, prompt, first, expected)
        assert_greedy_equal(model, prompt, second, expected)
    assert engine.core.blocks.num_free_blocks == engine.core.blocks.num_blocks  # nothing leaked


@pytest.mark.compiled
@pytest.mark.skipif(paged_attention_kernel() is None, reason="the paged attention kernel is not built")
@pytest.mark.parametrize("block_size", [4, 1])  # the warm-up's three tokens stay inside one-slot blocks too
def test_compile_writes_only_the_spare_block(block_size):
    model = make_model("llama", torch.float32, "sdpa")
    kv = KVPool(KVShape.from_config(model.config), num_blocks=3, block_size=block_size, dtype=torch.float32,
                device=torch.device("cpu"), spare_block=True)
    for pool in kv.keys + kv.values:  # [kv_heads, blocks + spare, block_size, head_dim]
        pool.fill_(7.0)  # what live sequences' K/V would be
    forward = StepForward(model, kv, paged_attention_kernel(), keep_hidden=False, compile=True, max_blocks=3)
    forward.warm_up(background=True)
    forward._compiler.join(COMPILE_TIMEOUT)
    assert not forward.compiling and forward._compiled_graphs is not None
    for pool in kv.keys + kv.values:
        assert (pool[:, :3] == 7.0).all()  # the pool's blocks: untouched
        assert (pool[:, 3] != 7.0).any()  # the warm-up wrote into the spare block


def test_background_compile_is_ignored_when_eager_or_with_a_compiling_proposer():
    model = make_model("llama", torch.float32, "sdpa")
    engine = Engine(model, config=EngineConfig(block_size=4, enforce_eager=True, compile_in_background=True))
    assert not engine.compiling and not engine.core.runner.forward.compiled
    assert engine.core.kv.spare_block is None  # nothing compiles: no scratch block outside the K/V budget
    draft = make_model("llama", torch.float32, "sdpa")
    engine = Engine(model, config=EngineConfig(block_size=4, enforce_eager=True, compile_in_background=True),
                    speculative=SpeculativeConfig("draft", model=draft, num_speculative_tokens=2))
    assert engine.core.kv.spare_block is None  # the draft model compiles at start, and so does the step


def test_compile_in_background_must_be_a_bool():
    with pytest.raises(TypeError, match="compile_in_background"):
        EngineConfig(compile_in_background="yes")


def test_attention_switch_is_shared_between_threads():
    model = make_model("llama", torch.float32, "sdpa")
    own = model.config._attn_implementation
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with attention_implementation(model, ATTENTION_NAME):
            first_in.set()
            second_in.wait(60)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(60)
    with attention_implementation(model, ATTENTION_NAME):
        second_in.set()
        assert first_out.wait(60)  # the first block has ended: the switch holds for this one
        seen.append(model.config._attn_implementation)
        with pytest.raises(RuntimeError, match="another block"):
            with attention_implementation(model, "sdpa"):
                pass
    thread.join(60)
    assert not thread.is_alive() and seen == [ATTENTION_NAME] and model.config._attn_implementation == own


@pytest.mark.compiled
@pytest.mark.skipif(paged_attention_kernel() is None, reason="the paged attention kernel is not built")
def test_shutdown_stops_a_background_compile():
    model = make_model("llama", torch.float32, "sdpa")
    with warnings.catch_warnings(record=True) as caught:  # process-wide: the compile thread's warnings too
        warnings.simplefilter("always")
        engine = Engine(model, config=EngineConfig(max_num_seqs=2, block_size=4, compile_in_background=True))
        engine.shutdown()
        engine.core.runner.forward._compiler.join(COMPILE_TIMEOUT)  # ends at its next graph
    assert not engine.compiling and not engine.core.runner.forward.compiled
    assert not [w for w in caught if "compiling the engine's model step failed" in str(w.message)]  # no failure
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4  # eager steps serve on
