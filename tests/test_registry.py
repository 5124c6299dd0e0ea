"""Registration with transformers: idempotent, reload-safe, exactly reversible, and what it changes in generate."""

import importlib
import json
import subprocess
import sys

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

import hf_accel
from tiny_llama import tiny_llama
from hf_accel import PagedCache, registry

PATCHED = ("generate", "_prepare_cache_for_generation", "_prefill")
STOCK_CACHE_NAMES = configuration_utils.ALL_STATIC_CACHE_IMPLEMENTATIONS + configuration_utils.DYNAMIC_CACHE_IMPLEMENTATIONS


def wrapping_layers(attr: str) -> tuple[int, object]:
    """How many hf_accel wrappers sit on `GenerationMixin.<attr>`, and the function under them."""
    function, layers = GenerationMixin.__dict__[attr], 0
    while hasattr(function, "__hf_accel_original__"):
        function, layers = function.__hf_accel_original__, layers + 1
    return layers, function


PRISTINE = {attr: wrapping_layers(attr)[1] for attr in PATCHED}


def assert_registered_once():
    for attr in PATCHED:
        layers, original = wrapping_layers(attr)
        assert layers == 1, f"{attr} wrapped {layers} times"
        assert original is PRISTINE[attr]
        assert GenerationMixin.__dict__[attr].__wrapped__ is PRISTINE[attr]
    assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS == STOCK_CACHE_NAMES + tuple(hf_accel.CACHE_BUILDERS)
    assert registry.is_registered()


class NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.fixture
def restores_registration():
    """Whatever the test does to the registration, leave hf_accel registered exactly once afterwards."""
    yield
    hf_accel.register()
    assert_registered_once()


@pytest.fixture
def unregistered(restores_registration):
    hf_accel.unregister()
    yield


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(num_hidden_layers=1, seed=1)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(2, 128, (1, 10), generator=torch.Generator().manual_seed(0))


# --- registration mechanics ---------------------------------------------------------------------------------------


def test_the_pristine_functions_are_transformers_own():
    for attr in PATCHED:
        assert PRISTINE[attr].__qualname__ == f"GenerationMixin.{attr}"
        assert PRISTINE[attr].__module__ == "transformers.generation.utils"


def test_importing_hf_accel_registers():
    assert_registered_once()
    assert "paged" not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS  # stock "paged" handling is ours to intercept


def test_register_twice_wraps_once(restores_registration):
    hf_accel.register()
    hf_accel.register()
    assert_registered_once()


def test_reload_of_the_package_wraps_once(restores_registration):
    importlib.reload(hf_accel)
    assert_registered_once()
    importlib.reload(hf_accel)
    assert_registered_once()
    assert hf_accel.PagedCache is PagedCache


def test_reload_of_the_registry_wraps_once(restores_registration):
    importlib.reload(hf_accel.registry)
    assert_registered_once()
    hf_accel.register()
    assert_registered_once()
    importlib.reload(hf_accel.registry)
    hf_accel.unregister()
    for attr in PATCHED:
        assert GenerationMixin.__dict__[attr] is PRISTINE[attr]


def test_the_prefix_store_is_still_consulted_after_a_reload_of_the_registry(restores_registration, model):
    # a notebook's autoreload re-runs registry.py; the prefill hook must still recognise the caches built before
    importlib.reload(hf_accel.registry)
    hf_accel.register()
    store = hf_accel.PrefixStore(model, max_memory="16MiB")
    prompt = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.generate(prompt, max_new_tokens=2, do_sample=False, cache_implementation="paged",
                       cache_config={"block_size": 16, "prefix_store": store})
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.tokens_saved) == (1, 1, 32)


def test_unregister_restores_transformers_exactly(unregistered):
    for attr in PATCHED:
        assert GenerationMixin.__dict__[attr] is PRISTINE[attr]
    assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS == STOCK_CACHE_NAMES
    assert type(configuration_utils.ALL_CACHE_IMPLEMENTATIONS) is tuple
    assert not registry.is_registered()
    hf_accel.unregister()  # safe when not registered
    for attr in PATCHED:
        assert GenerationMixin.__dict__[attr] is PRISTINE[attr]
    assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS == STOCK_CACHE_NAMES


# What transformers' registries hold, as names of what they hold: run in a fresh process, after `setup`.
REGISTRIES_SNAPSHOT = """
import json, sys
{setup}
from transformers import AttentionInterface
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

def named(mapping):
    return {{key: f"{{value.__module__}}.{{value.__qualname__}}" for key, value in mapping.items()}}

json.dump({{
    "attention": named(AttentionInterface._global_mapping),
    "attention_masks": named(AttentionMaskInterface._global_mapping),
    "quantizers": named(AUTO_QUANTIZER_MAPPING),
    "quantization_configs": named(AUTO_QUANTIZATION_CONFIG_MAPPING),
    "cache_names": list(configuration_utils.ALL_CACHE_IMPLEMENTATIONS),
    "generate": named({{attr: GenerationMixin.__dict__[attr] for attr in {patched!r}}}),
}}, sys.stdout)
"""

USE_THEN_UNREGISTER = """
import torch
import hf_accel
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).eval()
engine = hf_accel.Engine(model, config=hf_accel.EngineConfig(enforce_eager=True))
engine.generate([[1, 2, 3]], hf_accel.SamplingParams(max_tokens=2))
hf_accel.quantize_model(model, hf_accel.WeightOnlyConfig(bits=8))
hf_accel.unregister()
"""


def registries_after(setup: str) -> dict:
    code = REGISTRIES_SNAPSHOT.format(setup=setup, patched=PATCHED)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_after_unregister_transformers_registries_equal_a_fresh_imports():
    """Everything `register` adds (generate hooks, cache names, attention functions, quantization methods) is gone
    after `unregister`, even after the engine and the weight quantizer ran: the registries read as a process that
    never imported hf_accel."""
    fresh = registries_after("import transformers")
    used = registries_after(USE_THEN_UNREGISTER)
    assert used == fresh
    registered = registries_after("import hf_accel")
    assert set(registered["attention"]) - set(fresh["attention"]) == set(hf_accel.ATTENTION_FUNCTIONS)
    assert set(registered["quantizers"]) - set(fresh["quantizers"]) == set(hf_accel.QUANTIZATION_METHODS)


def test_without_registration_the_engine_says_how_to_register_again(unregistered, model):
    with pytest.raises(RuntimeError, match=r"hf_accel.register\(\)"):
        engine = hf_accel.Engine(model, config=hf_accel.EngineConfig(enforce_eager=True))
        engine.generate([[1, 2, 3]], hf_accel.SamplingParams(max_tokens=2))


def test_after_unregister_paged_is_stock_continuous_batching_again(unregistered, model, prompt):
    stop = StoppingCriteriaList([NeverStop()])
    with pytest.raises(NotImplementedError, match="not supported for continuous batching"):
        model.generate(prompt, max_new_tokens=2, cache_implementation="paged", stopping_criteria=stop)
    with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
        model.generate(prompt, max_new_tokens=2, cache_implementation=registry.PAGED_ALIAS)


def test_registered_paged_takes_the_ordinary_generate_path(model, prompt):
    stop = StoppingCriteriaList([NeverStop()])
    out = model.generate(
        prompt, max_new_tokens=2, do_sample=False, cache_implementation="paged", stopping_criteria=stop,
        return_dict_in_generate=True,
    )
    assert type(out.past_key_values) is PagedCache
    assert out.sequences.shape == (1, 12)


# --- cache_implementation from a GenerationConfig, and persistence ------------------------------------------------


def test_paged_from_a_generation_config_object(model, prompt):
    config = GenerationConfig(
        cache_implementation="paged", cache_config={"block_size": 4}, max_new_tokens=3, do_sample=False,
        return_dict_in_generate=True,
    )
    out = model.generate(prompt, generation_config=config)
    assert type(out.past_key_values) is PagedCache
    assert out.past_key_values.tables.block_size == 4
    assert config.cache_implementation == "paged"


def test_paged_from_the_models_default_generation_config(model, prompt):
    model.generation_config.cache_implementation = "paged"
    try:
        out = model.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    finally:
        model.generation_config.cache_implementation = None
    assert type(out.past_key_values) is PagedCache


def saved_generation_config(model, path) -> str:
    model.save_pretrained(path)
    return (path / "generation_config.json").read_text()


def test_hf_accel_names_are_never_saved(model, prompt, tmp_path):
    model.generate(prompt, max_new_tokens=2, cache_implementation="paged", cache_config={"block_size": 4})
    model.generate(prompt, generation_config=GenerationConfig(cache_implementation="paged", max_new_tokens=2))
    text = saved_generation_config(model, tmp_path / "after_kwarg")
    assert "hf_accel" not in text and "paged" not in text

    model.generation_config.cache_implementation = "paged"
    try:
        model.generate(prompt, max_new_tokens=2)
        text = saved_generation_config(model, tmp_path / "model_default")
    finally:
        model.generation_config.cache_implementation = None
    assert "hf_accel" not in text
    assert json.loads(text)["cache_implementation"] == "paged"  # the user's own, stock-valid name


def test_a_model_saved_after_paged_generation_loads_without_hf_accel(model, prompt, tmp_path, unregistered):
    hf_accel.register()
    model.generate(prompt, max_new_tokens=2, cache_implementation="paged")
    model.save_pretrained(tmp_path)
    hf_accel.unregister()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert reloaded.generation_config.cache_implementation is None


# --- assisted decoding --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_implementation, cache_type", [("dynamic", DynamicCache), ("paged", PagedCache)])
def test_assisted_decoding_with_a_cache_implementation(model, draft, prompt, cache_implementation, cache_type):
    greedy = model.generate(prompt, max_new_tokens=12, do_sample=False)
    out = model.generate(
        prompt, max_new_tokens=12, do_sample=False, assistant_model=draft,
        cache_implementation=cache_implementation, return_dict_in_generate=True,
    )
    assert type(out.past_key_values) is cache_type
    assert torch.equal(out.sequences, greedy)


def test_stock_assisted_decoding_with_a_cache_implementation_fails_in_round_two(unregistered, model, draft, prompt):
    with pytest.raises(ValueError, match="Passing both `cache_implementation`"):
        model.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=draft, cache_implementation="dynamic")
