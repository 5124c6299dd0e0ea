"""`medusa_generate` under `compile_config` (`hf_accel/compiled/medusa_loop.py`): each round's tree verified in one
compiled forward through the paged tree attention, the accepted path moved into place in the pool. Greedy output
equals plain greedy `generate` token for token at batch 1 and in left-padded batches, with a wide tree (every round
accepts), the heads' default tree with its adaptive sizer (root-only plain rounds included), a sliding-window model
and the GPU's attention rule; EOS stops rows as transformers does; uncovered calls decode eagerly with a warning."""

import pytest
import torch
from transformers import CompileConfig

from conformance import EOS, PAD, make_model, make_prompts
from hf_accel.compiled import target_rounds
from hf_accel.speculative.medusa import medusa_generate
from hf_accel.speculative.stats import SpeculativeStats
from test_medusa_generate import WIDE, heads_for

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)
NEW = 24
MODELS = {}


def _model(arch):
    if arch not in MODELS:
        MODELS[arch] = make_model(arch, torch.float32, "sdpa")
    return MODELS[arch]


def _plain(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **kwargs)


def _medusa(model, inputs, tree=WIDE, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **kwargs}
    return model.generate(**inputs, compile_config=COMPILE, custom_generate=medusa_generate,
                          medusa_heads=heads_for(model), medusa_tree=tree, **kwargs)


@pytest.mark.parametrize("lengths", [[13], [6, 17, 11]])
@pytest.mark.parametrize("tree", ["wide", "default"])
def test_compiled_medusa_equals_plain_greedy(lengths, tree):
    model = _model("llama")
    stats = SpeculativeStats()
    for seed in (1, 2):
        inputs = make_prompts(lengths, seed=seed)
        out = _medusa(model, inputs, tree=WIDE if tree == "wide" else None, medusa_stats=stats,
                      return_dict_in_generate=True)
        assert out.past_key_values is None  # the compiled loop ran (the eager one returns generate's cache)
        assert torch.equal(out.sequences, _plain(model, inputs)), f"seed {seed}"
    assert sum(stats.accepted) > 0
    if tree == "wide":  # depth 1 holds every token: every row's every round accepts one
        assert stats.accepted[0] == stats.num_row_rounds


def test_compiled_medusa_on_a_sliding_window_model_and_with_the_gpu_rule(monkeypatch):
    model = _model("qwen2")  # a full and a sliding layer; prompts and outputs run past the window
    inputs = make_prompts([14, 25], seed=3)
    assert torch.equal(_medusa(model, inputs, tree=[(0,), (1,), (0, 0)]), _plain(model, inputs))
    monkeypatch.setattr(target_rounds, "paged_tree_attention_kernel", lambda: None)  # decode_attention's tree rule
    assert torch.equal(_medusa(model, inputs, tree=[(0,), (1,), (0, 0)]), _plain(model, inputs))


def test_compiled_medusa_stops_rows_at_eos_as_generate_does():
    model = _model("llama")
    inputs = make_prompts([9, 15, 5], seed=5)
    eos = int(_plain(model, inputs)[1, -10])  # a token row 1 emits mid-way: it stops there, later rows padded
    assert torch.equal(_medusa(model, inputs, eos_token_id=eos), _plain(model, inputs, eos_token_id=eos))
    assert torch.equal(_medusa(model, inputs, eos_token_id=[eos, EOS]), _plain(model, inputs, eos_token_id=[eos, EOS]))


def test_uncovered_calls_decode_eagerly_with_a_warning():
    model = _model("llama")
    inputs = make_prompts([9], seed=2)
    with pytest.warns(UserWarning, match="compile_config is not applied to medusa_generate"):
        sampled = _medusa(model, inputs, do_sample=True, top_k=5, return_dict_in_generate=True)
    assert sampled.past_key_values is not None  # the eager loop ran
    windowed = _model("qwen2")
    with pytest.warns(UserWarning, match="no longer than the tree"):
        _medusa(windowed, inputs)  # WIDE has more nodes than the window
