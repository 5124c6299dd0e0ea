"""LoRA adapters served unmerged by the Engine (`lora=hf_accel.LoRAConfig`, `lora_request=`): every request's greedy
output equals its adapter's merged model's (peft `merge_and_unload`, fp32) in a batch that mixes three adapters (of
different ranks, target modules, rsLoRA and `alpha_pattern`) with the base; with fewer slots than adapters (requests
wait for a slot), under preemption, with n-gram speculation; the prefix cache never shares blocks between adapters
or with the base; folders that cannot be served are a ValueError naming the adapter and what is wrong."""

import copy
import json

import pytest
import torch

from hf_accel import Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams, SpeculativeConfig
from hf_accel.kernels.custom_ops import lora_kernel
from hf_accel.speculative.medusa_heads import MedusaConfig, MedusaHeads

peft = pytest.importorskip("peft")

from tiny_llama import tiny_llama  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33, 2, 71, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [3, 3, 3], [100, 7, 64, 12, 90]]
ADAPTERS = {  # name -> peft LoraConfig arguments
    "attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp": {"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"], "use_rslora": True},
    "all": {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"],
            "alpha_pattern": {"o_proj": 4}},
}


@pytest.fixture(scope="module")
def base():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """name -> (LoRARequest, the adapter merged into a copy of the base)."""
    folder = tmp_path_factory.mktemp("adapters")
    made = {}
    for lora_id, (name, settings) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(lora_id)
        tuned = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **settings))
        with torch.no_grad():
            for param_name, param in tuned.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.5)  # a visible change of the outputs, not a different model
        tuned.save_pretrained(folder / name)
        made[name] = (LoRARequest(name, lora_id, str(folder / name)), tuned.merge_and_unload().eval())
    return made


def greedy(model, prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def mixed(adapters) -> list[tuple[list[int], str | None]]:
    """Every prompt under the base and each adapter, interleaved."""
    return [(prompt, name) for prompt in PROMPTS for name in (None, *adapters)]


def expected(base, adapters, jobs) -> list[list[int]]:
    return [greedy(base if name is None else adapters[name][1], prompt) for prompt, name in jobs]


def served(engine, adapters, jobs, params=GREEDY) -> list[list[int]]:
    requests = [None if name is None else adapters[name][0] for _, name in jobs]
    return [out.outputs[0].token_ids for out in engine.generate([p for p, _ in jobs], params, lora_request=requests)]


@pytest.mark.parametrize("eager", [False, True], ids=["compiled", "eager"])
def test_a_mixed_batch_equals_each_adapters_merged_model(base, adapters, eager):
    """Compiled (the hooks in the graphs, the adapters' weights and slots graph inputs) and eager alike."""
    jobs = mixed(adapters)
    want = expected(base, adapters, jobs)
    assert len({tuple(w) for w in want[:4]}) == 4  # the adapters change the outputs: the test can fail
    engine = Engine(copy.deepcopy(base), config=EngineConfig(max_num_seqs=16, enforce_eager=eager,
                                                             compile_in_background=False),
                    lora=LoRAConfig(max_loras=4))
    if not eager and lora_kernel() is None:
        pytest.skip("hf_accel's C++ extension is not built: LoRA steps run eagerly")
    assert engine.core.runner.forward.compiled == engine.core.adapters.compiled == (not eager)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert served(engine, adapters, jobs) == want
    assert served(engine, adapters, jobs[::-1]) == want[::-1]  # other slots, other batches: no recompile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert engine.core.blocks.pool.num_used_blocks == 0 and engine.core.adapters.slots.num_pinned == 0


def test_fewer_slots_than_adapters_requests_wait_for_one(base, adapters):
    jobs = mixed(adapters)
    engine = Engine(copy.deepcopy(base), config=EngineConfig(max_num_seqs=16),
                    lora=LoRAConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=16))
    assert served(engine, adapters, jobs) == expected(base, adapters, jobs)
    assert engine.core.adapters.slots.num_pinned == 0


def test_preemption_and_ngram_speculation_change_no_output(base, adapters):
    jobs = mixed(adapters)
    want = expected(base, adapters, jobs)
    shape = base.config
    per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * (shape.hidden_size // 4) * 4
    tight = Engine(copy.deepcopy(base), config=EngineConfig(kv_cache_memory=12 * 4 * per_token, block_size=4,
                                                            max_model_len=32),
                   lora=LoRAConfig(max_loras=2))
    assert served(tight, adapters, jobs) == want
    assert tight.stats().num_preemptions > 0
    assert tight.core.blocks.pool.num_used_blocks == 0 and tight.core.adapters.slots.num_pinned == 0
    speculating = Engine(copy.deepcopy(base), config=EngineConfig(max_num_seqs=16), lora=LoRAConfig(),
                         speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert served(speculating, adapters, jobs) == want


def test_a_base_draft_model_speculates_for_adapter_requests_losslessly(base, adapters):
    """The draft model drafts as the base; each request's candidates are verified by its own adapter: outputs equal
    the merged models', and the base's copy as draft gets candidates accepted for adapter requests too."""
    jobs = mixed(adapters)
    want = expected(base, adapters, jobs)
    draft = SpeculativeConfig("draft", model=copy.deepcopy(base), num_speculative_tokens=3,
                              max_speculative_batch_tokens=64)
    engine = Engine(copy.deepcopy(base), config=EngineConfig(max_num_seqs=16), lora=LoRAConfig(), speculative=draft)
    assert served(engine, adapters, jobs) == want
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0 and 0 < stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # adapters reject some


def test_the_prefix_cache_is_kept_per_adapter(base, adapters):
    engine = Engine(copy.deepcopy(base), config=EngineConfig(block_size=4), lora=LoRAConfig())
    prompt = list(range(10, 30))
    attn, mlp = adapters["attn"][0], adapters["mlp"][0]
    runs = [(None, 0), (attn, 0), (attn, 16), (mlp, 0), (None, 16)]  # adapter, prompt tokens found cached
    for request, cached in runs:
        [out] = engine.generate([prompt], GREEDY, lora_request=request)
        assert out.num_cached_tokens == cached, request
        merged = base if request is None else adapters[request.lora_name][1]
        assert out.outputs[0].token_ids == greedy(merged, prompt)


def test_adapters_that_cannot_be_served_are_refused_by_name(base, adapters, tmp_path):
    engine = Engine(copy.deepcopy(base), lora=LoRAConfig(max_lora_rank=8))
    attn = adapters["attn"][0]
    with pytest.raises(ValueError, match=r"adapter 'all': rank 16 .* max_lora_rank \(8\)"):
        engine.add_request([1, 2], GREEDY, lora_request=adapters["all"][0])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_request([1, 2], GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path / "missing")))
    engine.add_request([1, 2], GREEDY, lora_request=attn)
    with pytest.raises(ValueError, match="`lora_int_id` 1 is the adapter from"):
        engine.add_request([1, 2], GREEDY, lora_request=LoRARequest("other", 1, str(tmp_path)))
    with pytest.raises(TypeError, match="lora_request"):
        engine.add_request([1, 2], GREEDY, lora_request="attn")
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora cannot be served unmerged"):
        engine.add_request([1, 2], GREEDY, lora_request=LoRARequest("dora", 5, str(dora)))
    wider = peft.get_peft_model(_wider_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                               init_lora_weights=False))
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(ValueError, match="do not fit the base's Linear"):
        engine.add_request([1, 2], GREEDY, lora_request=LoRARequest("wider", 6, str(tmp_path / "wider")))
    head = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match="no adaptable Linear 'lm_head'"):
        engine.add_request([1, 2], GREEDY, lora_request=LoRARequest("head", 7, str(tmp_path / "head")))
    assert engine.generate([[1, 2]], GREEDY, lora_request=attn)[0].outputs[0].token_ids  # still serving


def test_engine_and_config_arguments_are_checked(base, adapters):
    with pytest.raises(ValueError, match="`lora_request` needs an engine built with `lora="):
        Engine(copy.deepcopy(base)).add_request([1, 2], GREEDY, lora_request=adapters["attn"][0])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/tmp")
    with pytest.raises(TypeError, match="`lora` must be a hf_accel.LoRAConfig"):
        Engine(copy.deepcopy(base), lora={"max_loras": 2})
    heads = MedusaHeads(MedusaConfig(2, base.config.hidden_size, base.config.vocab_size))
    with pytest.raises(ValueError, match="not 'medusa': EAGLE and Medusa heads draft from the target's hidden"):
        Engine(copy.deepcopy(base), lora=LoRAConfig(), speculative=SpeculativeConfig("medusa", model=heads))


def _wider_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def test_an_adapter_gone_before_its_request_starts_fails_that_request_alone(base, adapters, tmp_path):
    import shutil

    copy_folder = tmp_path / "copy"
    shutil.copytree(adapters["attn"][0].lora_path, copy_folder)
    engine = Engine(copy.deepcopy(base), lora=LoRAConfig(max_loras=1, max_cpu_loras=1))
    failed = []
    engine.add_request([4, 5, 6], GREEDY, lora_request=LoRARequest("copy", 9, str(copy_folder)),
                       listener=lambda out: failed.append(out))
    mlp = adapters["mlp"][0]
    engine.add_request([1, 2], GREEDY, lora_request=mlp)  # read now: memory drops "copy" (max_cpu_loras=1)
    shutil.rmtree(copy_folder)  # so the engine must read it again when the request arrives, and cannot
    [out] = engine.generate([[7, 8, 9]], GREEDY, lora_request=mlp)
    assert out.outputs[0].token_ids == greedy(adapters["mlp"][1], [7, 8, 9])
    assert failed and failed[-1].outputs[0].finish_reason == "error" and "adapter 'copy'" in failed[-1].error.message
    assert engine.core.blocks.pool.num_used_blocks == 0 and engine.core.adapters.slots.num_pinned == 0


def test_an_id_never_names_a_second_folder_even_after_memory_dropped_the_first(base, adapters):
    engine = Engine(copy.deepcopy(base), lora=LoRAConfig(max_loras=1, max_cpu_loras=1))
    attn, mlp = adapters["attn"][0], adapters["mlp"][0]
    engine.generate([[1, 2, 3]], GREEDY, lora_request=attn)  # resident in the slot, in memory
    engine.generate([[1, 2, 3]], GREEDY, lora_request=mlp)  # memory and the slot now hold "mlp"
    with pytest.raises(ValueError, match="`lora_int_id` 1 is the adapter from"):
        engine.add_request([1, 2], GREEDY, lora_request=LoRARequest("mlp again", 1, mlp.lora_path))


def test_a_request_failing_as_one_of_its_samples_finishes_lets_go_of_everything(base, adapters, monkeypatch):
    engine = Engine(copy.deepcopy(base), lora=LoRAConfig(max_loras=1))
    attn, mlp = adapters["attn"][0], adapters["mlp"][0]
    real = engine.core.committer._commit_one
    calls = []

    def second_sample_fails(*args, **kwargs):  # sample 1 raises in the step where sample 0 finishes
        calls.append(args)
        if len(calls) == 2 * GREEDY.max_tokens:
            raise RuntimeError("a fault of sample 1")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.core.committer, "_commit_one", second_sample_fails)
    params = SamplingParams(n=2, max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True)
    [failed] = engine.generate([[4, 5, 6]], params, lora_request=attn)
    assert failed.error is not None
    assert engine.core.blocks.pool.num_used_blocks == 0 and engine.core.adapters.slots.num_pinned == 0
    monkeypatch.setattr(engine.core.committer, "_commit_one", real)
    [out] = engine.generate([[7, 8, 9]], GREEDY, lora_request=mlp)  # the only slot is free again
    assert out.outputs[0].token_ids == greedy(adapters["mlp"][1], [7, 8, 9])


def test_a_streamed_request_runs_with_its_adapter(base, adapters):
    import asyncio

    engine = Engine(copy.deepcopy(base), lora=LoRAConfig())
    attn = adapters["attn"][0]

    async def last_output():
        async for out in engine.stream([4, 9, 2, 11], GREEDY, lora_request=attn):
            final = out
        return final

    try:
        final = asyncio.run(last_output())
    finally:
        engine.shutdown()
    assert final.finished and final.outputs[0].token_ids == greedy(adapters["attn"][1], [4, 9, 2, 11])


def test_add_and_remove_lora_read_ahead_and_free_an_adapter(base, adapters):
    """vLLM's `add_lora` reads an adapter before its first request; `remove_lora` drops it from memory and from its
    slot (at the next step), and a later request with its id reads the folder again, with the same outputs."""
    engine = Engine(copy.deepcopy(base), lora=LoRAConfig(max_loras=2))
    (attn, _), (mlp, _) = adapters["attn"], adapters["mlp"]
    jobs = [(PROMPTS[0], "attn"), (PROMPTS[1], "mlp")]
    want = expected(base, adapters, jobs)
    engine.add_lora(attn)
    assert len(engine.core.adapters.adapters) == 1
    assert served(engine, adapters, jobs) == want
    engine.remove_lora(attn.lora_int_id)
    engine.step()  # applied at the start of a step
    lora = engine.core.adapters
    assert len(lora.adapters) == 1 and lora.slots.slot_of(attn.lora_int_id) is None
    assert lora.slots.slot_of(mlp.lora_int_id) is not None  # the other one stays
    assert served(engine, adapters, jobs) == want
    with pytest.raises(ValueError, match="lora_int_id"):
        engine.remove_lora(0)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        Engine(copy.deepcopy(base)).remove_lora(1)
    with pytest.raises(ValueError, match="needs an engine built with `lora="):
        Engine(copy.deepcopy(base)).add_lora(attn)
