"""Compiled graphs kept across processes (inductor's FX graph cache, keyed by a fingerprint of the frozen weights):
a new process on the same weights loads them, one on other weights of the same shapes compiles its own, and the
tokens equal eager generation in every process."""

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


def _run(cache: Path, seed: int, draft: int | None = None) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", _PROCESS, str(seed), "-" if draft is None else str(draft)],
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
