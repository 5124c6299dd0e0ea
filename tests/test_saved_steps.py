"""Engine steps saved on disk whole (`runtime/saved_steps.py`): on Llama, Mistral (every layer sliding) and Gemma 2
(soft-capping) a second engine on another model of the same shapes loads both steps and traces nothing, with greedy
tokens equal to eager generate's; engines on one model with other pools get steps of their own (saved steps run
without guards); a LoRA engine's steps (hooks that describe themselves) load on another model likewise, with each
request's greedy tokens equal to its adapter's merged model's, and other LoRA limits get steps of their own; models
with other forward hooks and bf16 models never save; the key follows every input's layout and the model's shape and
code. Restarts in new processes: tests/test_graph_cache.py."""

import copy

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import transformers
from transformers.models.llama import modeling_llama

from conformance import ARCHITECTURES, make_model
from engine_helpers import assert_greedy_equal, greedy_reference, random_prompts
from hf_accel import Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams
from hf_accel.kernels.custom_ops import paged_attention_kernel
from hf_accel.runtime.saved_steps import describe, model_description, step_key

pytestmark = [pytest.mark.compiled,
              pytest.mark.skipif(paged_attention_kernel() is None, reason="the paged attention kernel is not built")]

LENGTHS, MAX_TOKENS = [5, 21, 1, 9], [7, 3, 9, 5]


@pytest.fixture
def steps_folder(tmp_path, monkeypatch):
    """A fresh inductor cache folder (where saved steps lie), so every test starts with none saved."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path / "hf_accel_steps"


def counts() -> tuple[int, int]:
    """(graphs dynamo traced, steps loaded from disk) so far in this process."""
    return dynamo_utils.counters["stats"]["unique_graphs"], dynamo_utils.counters["hf_accel"]["saved_steps_loaded"]


def fresh(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A new tiny model (not `make_model`'s shared one, which other tests may have compiled or hooked)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        ARCHITECTURES[arch][0](), attn_implementation="eager" if arch == "gemma2" else "sdpa")
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def generate_checked(model, config: EngineConfig, seed: int = 3) -> Engine:
    """An engine on `model`, its greedy tokens checked against eager generate's."""
    engine = Engine(model, config=config)
    prompts = random_prompts(LENGTHS, seed=seed)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    for prompt, out, n in zip(prompts, engine.generate(prompts, params), MAX_TOKENS):
        assert_greedy_equal(model, prompt, out.outputs[0].token_ids, greedy_reference(model, prompt, n))
    return engine


def config(block_size: int = 4) -> EngineConfig:
    return EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=block_size)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_another_model_of_the_same_shapes_loads_both_steps(arch, steps_folder):
    traced, loaded = counts()
    generate_checked(fresh(arch), config())
    assert counts() == (traced + 2, loaded) and len(list(steps_folder.glob("*.bin"))) == 2
    other = fresh(arch)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.5)  # other weights, the same shapes
    generate_checked(other, config())
    assert counts() == (traced + 2, loaded + 2)


def test_engines_with_other_pools_on_one_model_get_steps_of_their_own(steps_folder):
    model = fresh("llama")
    generate_checked(model, config(block_size=4))
    traced, loaded = counts()
    generate_checked(model, config(block_size=8))  # another pool: the graphs fix its sizes
    assert counts() == (traced + 2, loaded) and len(list(steps_folder.glob("*.bin"))) == 4
    generate_checked(model, config(block_size=4))  # the first pool's steps, kept in this process
    assert counts() == (traced + 2, loaded)


def lora_checked(model, adapter: LoRARequest, max_rank: int = 8) -> None:
    """A LoRA engine on `model`: a batch of base and `adapter` requests, each equal to its own model's greedy tokens
    (the adapter merged into a copy of `model`, peft's `merge_and_unload`)."""
    peft = pytest.importorskip("peft")
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter.lora_path).merge_and_unload().eval()
    engine = Engine(model, config=config(), lora=LoRAConfig(max_loras=2, max_lora_rank=max_rank))
    prompts = random_prompts(LENGTHS, seed=5)
    requests = [adapter if i % 2 else None for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outs = engine.generate(prompts, params, lora_request=requests)
    for prompt, out, n, request in zip(prompts, outs, MAX_TOKENS, requests):
        reference = merged if request is not None else model
        assert_greedy_equal(reference, prompt, out.outputs[0].token_ids, greedy_reference(reference, prompt, n))
    # the adapter changes the tokens: a step that ran without it would fail the checks above
    assert any(greedy_reference(merged, p, n) != greedy_reference(model, p, n) for p, n in zip(prompts, MAX_TOKENS))


def test_a_lora_engines_steps_load_on_another_model_and_other_limits_get_their_own(steps_folder, tmp_path):
    peft = pytest.importorskip("peft")
    model = fresh("llama")
    adapters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        tuned = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
        tuned.save_pretrained(tmp_path / f"adapter{seed}")
        adapters.append(LoRARequest(f"adapter{seed}", seed, str(tmp_path / f"adapter{seed}")))
    traced, loaded = counts()
    lora_checked(model, adapters[0])
    assert counts() == (traced + 2, loaded) and len(list(steps_folder.glob("*.bin"))) == 2
    other = fresh("llama")
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.5)
    lora_checked(other, adapters[1])  # the hooks are the same, their tensors the step's inputs: both steps load
    assert counts() == (traced + 2, loaded + 2)
    lora_checked(fresh("llama"), adapters[0], max_rank=16)  # other stacks: steps of their own
    assert counts() == (traced + 4, loaded + 2) and len(list(steps_folder.glob("*.bin"))) == 4


def test_models_with_hooks_and_bf16_models_are_never_saved(steps_folder):
    hooked = fresh("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 0.5)
    generate_checked(hooked, config())
    engine = Engine(fresh("llama", torch.bfloat16), config=config())
    assert engine.core.runner.forward.compiled
    assert not steps_folder.exists() or not list(steps_folder.glob("*.bin"))


def test_the_key_follows_every_inputs_layout_and_the_models_shape_and_code(monkeypatch):
    kwargs = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "flag": False}
    model = make_model("llama", torch.float32, "sdpa")
    described = model_description(model, [("lm_head", 0)])
    key = step_key("step", True, described, kwargs)
    assert step_key("step", True, described, dict(kwargs)) == key
    assert step_key("step", True, described, {**kwargs, "input_ids": torch.zeros(1, 4, dtype=torch.long)}) != key
    assert step_key("step", True, described, {**kwargs, "input_ids": torch.zeros(1, 3, dtype=torch.int)}) != key
    assert step_key("step", True, described, {**kwargs, "flag": True}) != key
    assert step_key("step", False, described, kwargs) != key
    assert step_key("step", True, model_description(model, [("lm_head", 16)]), kwargs) != key
    other = make_model("mistral", torch.float32, "sdpa")
    assert step_key("step", True, model_description(other, [("lm_head", 0)]), kwargs) != key
    assert describe(torch.zeros(2, 3).t()) == ["tensor", [3, 2], [1, 3], "torch.float32", "cpu"]
    rotary = modeling_llama.apply_rotary_pos_emb  # a kernel library patching the modeling file at run time
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda *args, **kwargs: rotary(*args, **kwargs))
    assert model_description(model, [("lm_head", 0)]) != described
