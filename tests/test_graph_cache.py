"""Compiled graphs kept across processes. Compiled generate's graphs freeze the weights and are kept in inductor's FX
graph cache under a fingerprint of them: a new process on the same weights loads them, one on other weights of the same
shapes compiles its own. The engine's fp32 step functions hold no weight (`kernels/linear_panels.py`) and are saved
whole (`runtime/saved_steps.py`): a new process loads them without tracing anything, on any weights of the same
shapes; a corrupt file is compiled again with a warning, never run. The tokens equal eager generation in every
process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_accel.kernels.custom_ops import packed_linear_kernel
from hf_accel.runtime.frozen_graphs import weights_fingerprint

pytestmark = pytest.mark.compiled

TESTS = Path(__file__).parent
ROOT = TESTS.parent

# one process: the tiny Llama with seed `argv[1]`, greedy tokens eager and compiled (paged), FX cache counters; with
# a draft seed `argv[2]` (not "-"), compiled draft-model speculation instead, its draft of the target's shapes (so
# target and draft compile the same graphs, over different weights)
_PROCESS = """
import json, sys, torch, transformers
import torch._dynamo.utils as dynamo_utils
import hf_accel
from conformance import PAD, make_prompts, ARCHITECTURES

def tiny(seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"][0](), attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    return model.eval()

torch.set_num_threads(1)
model = tiny(int(sys.argv[1]))
inputs = make_prompts([7, 12])
kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD)
eager = model.generate(**inputs, **kwargs)
kwargs["compile_config"] = transformers.CompileConfig()
if sys.argv[2] == "-":
    compiled = model.generate(**inputs, cache_implementation="paged", **kwargs)
else:
    compiled = model.generate(**inputs, custom_generate=hf_accel.draft_generate, draft_model=tiny(int(sys.argv[2])),
                              **kwargs)
counters = dynamo_utils.counters["inductor"]
print(json.dumps({"equal": torch.equal(eager, compiled), "hits": counters["fxgraph_cache_hit"],
                  "misses": counters["fxgraph_cache_miss"]}))
"""


# one process: an Engine on the tiny Llama with seed `argv[1]`, its greedy tokens against eager generate's, how many
# graphs dynamo traced, and the warnings about saved steps
_ENGINE_PROCESS = """
import json, sys, warnings, torch, transformers
import torch._dynamo.utils as dynamo_utils
from hf_accel import Engine, EngineConfig, SamplingParams
from conformance import ARCHITECTURES

torch.set_num_threads(1)
torch.manual_seed(int(sys.argv[1]))
model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"][0](), attn_implementation="sdpa").eval()
prompts = [[5, 9, 14, 22, 31, 7, 3], [8, 1, 30]]
eager = [model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine = Engine(model, config=EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, block_size=4))
outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
print(json.dumps({"equal": [o.outputs[0].token_ids for o in outs] == eager,
                  "compiled": engine.stats().compile_seconds > 0,
                  "traced": dynamo_utils.counters["stats"]["unique_graphs"],
                  "warnings": [str(w.message) for w in caught if "saved engine step" in str(w.message)]}))
"""


# one process: a LoRA engine on the tiny Llama with seed `argv[1]` and a rank-4 adapter made with seed `argv[1]`,
# adapter and base requests against the merged model's and the base's greedy tokens, and how many graphs dynamo traced
_LORA_PROCESS = """
import copy, json, sys, tempfile, torch, transformers, peft
import torch._dynamo.utils as dynamo_utils
from hf_accel import Engine, EngineConfig, LoRAConfig, LoRARequest, SamplingParams
from conformance import ARCHITECTURES

torch.set_num_threads(1)
torch.manual_seed(int(sys.argv[1]))
model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"][0](), attn_implementation="sdpa").eval()
folder = tempfile.mkdtemp()
peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                          init_lora_weights=False)).save_pretrained(folder)
merged = peft.PeftModel.from_pretrained(copy.deepcopy(model), folder).merge_and_unload().eval()
adapter = LoRARequest("adapter", 1, folder)
prompts, chosen = [[5, 9, 14, 22, 31, 7, 3], [8, 1, 30], [4, 4, 17]], [adapter, None, adapter]
want = [(merged if a else model).generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                          pad_token_id=0)[0, len(p):].tolist() for p, a in zip(prompts, chosen)]
engine = Engine(model, config=EngineConfig(max_num_seqs=3, max_num_batched_tokens=16, block_size=4),
                lora=LoRAConfig(max_loras=2, max_lora_rank=8))
outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), lora_request=chosen)
print(json.dumps({"equal": [o.outputs[0].token_ids for o in outs] == want, "adapted": want[0] != want[1],
                  "traced": dynamo_utils.counters["stats"]["unique_graphs"]}))
"""


def _run(cache: Path, seed: int, draft: int | None = None, process: str = _PROCESS) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    arguments = [] if process in (_ENGINE_PROCESS, _LORA_PROCESS) else ["-" if draft is None else str(draft)]
    done = subprocess.run([sys.executable, "-c", process, str(seed), *arguments],
                          capture_output=True, text=True, timeout=900, env=env, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_a_restart_loads_the_graphs_of_the_same_weights_only(tmp_path):
    first = _run(tmp_path, 0)
    assert first["equal"] and first["misses"] > 0 and first["hits"] == 0
    other = _run(tmp_path, 1)  # same shapes, other weights: another fingerprint, so its own graphs
    assert other["equal"] and other["hits"] == 0, other
    again = _run(tmp_path, 0)
    assert again["equal"] and again["hits"] > 0 and again["misses"] == 0, again


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_speculation_keys_each_graph_by_the_weights_it_freezes(tmp_path):
    """Target and draft compile the same graphs; each is keyed by its own weights: the draft's never load the
    target's panels (its first call would hit the target's entry otherwise), and a new draft only misses its own."""
    first = _run(tmp_path, 0, draft=10)
    assert first["equal"] and first["misses"] > 0 and first["hits"] == 0, first
    other_draft = _run(tmp_path, 0, draft=11)  # the same target: its graphs hit; the draft's miss
    assert other_draft["equal"] and other_draft["misses"] > 0 and other_draft["hits"] > 0, other_draft
    again = _run(tmp_path, 0, draft=10)
    assert again["equal"] and again["hits"] > 0 and again["misses"] == 0, again


def test_the_fingerprint_follows_the_weights():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = weights_fingerprint((model,))
    assert weights_fingerprint((model,)) == before
    with torch.no_grad():
        model[1].bias.add_(1.0)
    assert weights_fingerprint((model,)) != before
    twin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    twin.load_state_dict(model.state_dict())
    assert weights_fingerprint((twin,)) == weights_fingerprint((model,))
    assert weights_fingerprint((model, twin)) != weights_fingerprint((model,))


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_a_corrupt_cache_entry_is_compiled_again_never_used(tmp_path):
    first = _run(tmp_path, 0)
    entries = [path for path in (tmp_path / "fxgraph").rglob("*") if path.is_file()]
    assert first["equal"] and entries
    for path in entries:  # a half-written entry: what a process killed mid-write leaves
        path.write_bytes(path.read_bytes()[:100])
    again = _run(tmp_path, 0)
    assert again["equal"] and again["hits"] == 0 and again["misses"] > 0, again  # inductor warns and recompiles
    last = _run(tmp_path, 0)  # the entries written again are whole
    assert last["equal"] and last["hits"] > 0 and last["misses"] == 0, last


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_an_engine_restart_loads_its_steps_whole_on_any_weights_of_the_same_shapes(tmp_path):
    first = _run(tmp_path, 0, process=_ENGINE_PROCESS)
    assert first["equal"] and first["compiled"] and first["traced"] == 2 and not first["warnings"], first
    saved = sorted((tmp_path / "hf_accel_steps").glob("*.bin"))
    assert len(saved) == 2 and all(path.with_suffix(".json").exists() for path in saved)
    again = _run(tmp_path, 0, process=_ENGINE_PROCESS)  # nothing traced: both steps loaded
    assert again["equal"] and again["traced"] == 0 and not again["warnings"], again
    other = _run(tmp_path, 1, process=_ENGINE_PROCESS)  # the steps hold no weight: another model's tokens from them
    assert other["equal"] and other["traced"] == 0, other
    assert sorted((tmp_path / "hf_accel_steps").glob("*.bin")) == saved


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_a_lora_engine_restart_loads_its_steps_on_other_weights_and_adapters(tmp_path):
    """LoRA's hooks describe themselves, so a LoRA engine's steps are saved too; its adapters' weights and slots are
    the steps' inputs: another model with another adapter runs them with its own tokens."""
    pytest.importorskip("peft")
    first = _run(tmp_path, 0, process=_LORA_PROCESS)
    assert first["equal"] and first["adapted"] and first["traced"] == 2, first
    assert len(list((tmp_path / "hf_accel_steps").glob("*.bin"))) == 2
    other = _run(tmp_path, 1, process=_LORA_PROCESS)
    assert other["equal"] and other["adapted"] and other["traced"] == 0, other


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_a_corrupt_saved_step_is_compiled_again_with_a_warning_never_run(tmp_path):
    _run(tmp_path, 0, process=_ENGINE_PROCESS)
    saved = sorted((tmp_path / "hf_accel_steps").glob("*.bin"))
    saved[0].write_bytes(saved[0].read_bytes()[:1000])  # what a disk full or a killed copy leaves
    again = _run(tmp_path, 0, process=_ENGINE_PROCESS)
    assert again["equal"] and again["traced"] == 1 and len(again["warnings"]) == 1, again
    assert "compiling it again" in again["warnings"][0]
    last = _run(tmp_path, 0, process=_ENGINE_PROCESS)  # written again whole
    assert last["equal"] and last["traced"] == 0 and not last["warnings"], last


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_saved_steps_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ACCEL_SAVED_STEPS", "0")
    for _ in range(2):
        done = _run(tmp_path, 0, process=_ENGINE_PROCESS)
        assert done["equal"] and done["traced"] == 2, done
    assert not (tmp_path / "hf_accel_steps").exists()
