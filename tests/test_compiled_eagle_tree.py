"""`eagle_generate` with `eagle_tree` under `compile_config` (`hf_accel/compiled/eagle_tree_loop.py`): EAGLE-2 trees
grown by compiled head passes over the head's paged pool (the paged tree attention with a mask over the round's
earlier levels) and verified in one compiled target forward. Every round grows the tree the eager loop grows
(tokens equal, scores within float error: the head pool's entries are exact), greedy output equals plain greedy
`generate` at batch 1 and in left-padded batches; EOS stops rows as generate does; sampled trees, and trees longer
than a sliding window, decode eagerly with a warning. (The GPU's attention rule for trees is checked against the
kernel op by op in tests/test_tree_attention.py, windows through the tree verify in tests/test_compiled_medusa.py.)"""

import pytest
import torch
from transformers import CompileConfig

from conformance import EOS, PAD, make_model, make_prompts
from hf_accel import EagleHead, EagleTree, SpeculativeStats, eagle_generate
from hf_accel.compiled import eagle_tree_loop
from hf_accel.speculative import eagle as eager_loop
from test_compiled_eagle import _own_prompts
from test_eagle_generate import model_for, trained_head

pytestmark = pytest.mark.compiled

COMPILE = CompileConfig(fullgraph=True)
NEW = 24
TREE = EagleTree(total_tokens=10, depth=4, top_k=3)


def _plain(model, inputs, **kwargs):
    kwargs = {"max_new_tokens": NEW, **kwargs}
    return model.generate(**inputs, do_sample=False, pad_token_id=PAD, **kwargs)


def _tree(model, head, inputs, compiled=True, tree=TREE, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **kwargs}
    if compiled:
        kwargs["compile_config"] = COMPILE
    return model.generate(**inputs, custom_generate=eagle_generate, eagle_head=head, eagle_tree=tree, **kwargs)


def _recording(monkeypatch, module, trees: list) -> None:
    original = module.grow_tree

    def recorded(*args):
        tree, passes = original(*args)
        trees.append(tree)
        return tree, passes

    monkeypatch.setattr(module, "grow_tree", recorded)


def test_compiled_trees_equal_the_eager_loops_and_the_output_plain_greedy(monkeypatch):
    model = model_for("llama")
    head = trained_head(model)
    inputs = _own_prompts(model, [5, 12, 3])  # the head drafts its training text well: deep paths are accepted
    eager, compiled = [], []
    _recording(monkeypatch, eager_loop, eager)
    _recording(monkeypatch, eagle_tree_loop, compiled)
    stats, new = SpeculativeStats(), 40
    out = _tree(model, head, inputs, eagle_stats=stats, return_dict_in_generate=True, max_new_tokens=new)
    assert out.past_key_values is None  # the compiled loop ran (the eager one returns generate's cache)
    assert torch.equal(out.sequences, _plain(model, inputs, max_new_tokens=new))
    assert torch.equal(_tree(model, head, inputs, compiled=False, max_new_tokens=new), out.sequences)
    assert len(compiled) == len(eager) and stats.tokens_per_forward > 1.5, stats
    # a round emits at most depth + 1 tokens a row: before round (new - 1) // (depth + 1) every row is generating
    # (a finished row's tree is not compared: the loops keep different states for rows that stopped)
    for round_, (want, got) in enumerate(zip(eager[: (new - 1) // (TREE.depth + 1)], compiled)):
        assert torch.equal(got.tokens, want.tokens), round_
        torch.testing.assert_close(got.scores, want.scores, atol=1e-4, rtol=1e-4)
    for lengths in ([9], [7, 2]):  # random prompts: short paths; batch 1 gets graphs of its own
        inputs = make_prompts(lengths, seed=3)
        assert torch.equal(_tree(model, head, inputs, tree=EagleTree()), _plain(model, inputs))


def test_compiled_trees_stop_rows_at_eos_as_generate_does():
    model = model_for("llama")
    head = trained_head(model)
    inputs = _own_prompts(model, [9, 15, 5])
    eos = int(_plain(model, inputs)[1, -10])  # a token row 1 emits mid-way: it stops there, later rows padded
    assert torch.equal(_tree(model, head, inputs, eos_token_id=[eos, EOS]),
                       _plain(model, inputs, eos_token_id=[eos, EOS]))


def test_sampled_trees_and_short_windows_decode_eagerly_with_a_warning():
    model = model_for("llama")
    inputs = make_prompts([9], seed=2)
    with pytest.warns(UserWarning, match="compile_config is not applied to eagle_generate"):
        sampled = _tree(model, trained_head(model), inputs, do_sample=True, return_dict_in_generate=True)
    assert sampled.past_key_values is not None  # the eager loop ran
    windowed = make_model("qwen2", torch.float32, "sdpa")
    with pytest.warns(UserWarning, match="no longer than the tree"):
        _tree(windowed, EagleHead.for_model(windowed), inputs, tree=EagleTree(total_tokens=40))
