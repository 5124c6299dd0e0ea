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

# one process: the tiny Llama with seed `argv[1]`, greedy tokens eager and compiled (paged), FX cache counters
_PROCESS = """
import json, sys, torch, transformers
import torch._dynamo.utils as dynamo_utils
import hf_accel
from conformance import PAD, make_prompts, ARCHITECTURES
torch.set_num_threads(1)
torch.manual_seed(int(sys.argv[1]))
model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES["llama"][0](), attn_implementation="sdpa").eval()
model.generation_config.eos_token_id = None
inputs = make_prompts([7, 12])
kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD)
eager = model.generate(**inputs, **kwargs)
compiled = model.generate(**inputs, cache_implementation="paged",
                          compile_config=transformers.CompileConfig(fullgraph=True), **kwargs)
counters = dynamo_utils.counters["inductor"]
print(json.dumps({"equal": torch.equal(eager, compiled), "hits": counters["fxgraph_cache_hit"],
                  "misses": counters["fxgraph_cache_miss"]}))
"""


def _run(seed: int, cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(TESTS)}
    done = subprocess.run([sys.executable, "-c", _PROCESS, str(seed)], capture_output=True, text=True, timeout=900,
                          env=env, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(packed_linear_kernel() is None, reason="the packed-Linear kernel is not built here")
def test_a_restart_loads_the_graphs_of_the_same_weights_only(tmp_path):
    first = _run(0, tmp_path)
    assert first["equal"] and first["misses"] > 0 and first["hits"] == 0
    other = _run(1, tmp_path)  # same shapes, other weights: another fingerprint, so its own graphs
    assert other["equal"] and other["hits"] == 0, other
    again = _run(0, tmp_path)
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
