"""EAGLE-2 dynamic trees (`eagle_generate(..., eagle_tree=EagleTree(...))`) against plain generate on tiny models:
greedy token for token at batch 1 and in ragged batches, DynamicCache and paged cache, full and sliding-window
layers; every tree node's score equals the head's chain replay of its path (the tree entries' masks and positions are
exact); the pool's rerank keeps trees prefix-closed; a trained head gets more tokens per target forward from a tree
than from chains; bad input (compiled trees: test_compiled_eagle_tree.py). Sampling: test_eagle_sampling.py."""

import pytest
import torch
from conformance import PAD, make_model, make_prompts
from test_eagle_generate import NEW, model_for, own_text, run, trained_head

from hf_accel import EagleTree, SpeculativeStats, eagle_generate
from hf_accel.speculative import eagle, eagle_tree
from hf_accel.speculative.eagle_tree import _Pool, _tree_from_pool

TREE = EagleTree(total_tokens=8, depth=4, top_k=3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("cache_implementation, lengths",
                         [("dynamic", [9]), ("paged", [9]), ("dynamic", [5, 12, 3])])
def test_greedy_equals_plain(arch, cache_implementation, lengths):
    model = model_for(arch)
    inputs = make_prompts(lengths, seed=len(lengths))
    stats = SpeculativeStats()
    got = run(model, inputs, cache_implementation=cache_implementation, eagle_tree=TREE, eagle_stats=stats)
    assert torch.equal(got, run(model, inputs, eagle=False, cache_implementation=cache_implementation))
    assert stats.num_new_tokens == NEW * len(lengths)
    assert stats.num_target_forwards < NEW  # trees were accepted
    assert stats.draft_lengths and max(stats.draft_lengths) == TREE.total_tokens


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_layers_at_batch_1(arch):
    # mistral: every layer sliding; qwen2: one full and one sliding layer. Prompt + output outgrow the window
    model = make_model(arch, torch.float32, "sdpa")
    inputs = make_prompts([12], seed=4)
    for cache_implementation in ("dynamic", "paged"):
        kwargs = {"max_new_tokens": 40, "cache_implementation": cache_implementation}
        assert torch.equal(run(model, inputs, eagle_tree=TREE, **kwargs), run(model, inputs, eagle=False, **kwargs))


def test_tree_scores_equal_chain_replay(monkeypatch):
    """Each node's cumulative log probability, grown level by level over tree entries, equals the head drafting
    that node's path as a chain (`HeadState.draft_step`) from the same root."""
    model = model_for("llama")
    head = trained_head(model)
    checked, states = [], []
    original, original_expand = eagle_tree.grow_tree, eagle_tree.eager_expand

    def recording(state, model_, batch, top_k):
        states.append((state, model_, batch))
        return original_expand(state, model_, batch, top_k)

    def replaying(expand, hidden, roots, root_children, settings):
        tree, passes = original(expand, hidden, roots, root_children, settings)
        state, model_, batch = states[-1]
        state.drop_drafts()
        for node in range(1, tree.num_nodes):
            path = [node]
            while int(tree.depths[0, path[-1]]) > 1:
                path.append(_parent(tree.ancestors[0], path[-1]))
            path.reverse()
            step, total = hidden, 0.0
            for j, index in enumerate(path):
                token = tree.tokens[:, index]
                total += float(torch.log_softmax(head.logits(model_, step), dim=-1)[0, token[0]])
                if j + 1 < len(path):
                    step = state.draft_step(model_, batch, step, token, j)
            state.drop_drafts()
            assert abs(total - float(tree.scores[0, node])) < 1e-4, (node, path, total, tree.scores[0, node])
            checked.append(len(path))
        return tree, passes

    monkeypatch.setattr(eagle, "eager_expand", recording)
    monkeypatch.setattr(eagle, "grow_tree", replaying)
    run(model, make_prompts([9], seed=3), eagle_tree=EagleTree(total_tokens=64, depth=4, top_k=2))  # whole pools
    assert len(checked) > 20 and max(checked) == 4


def _parent(ancestors: torch.Tensor, node: int) -> int:
    # the deepest proper ancestor: the one with the most ancestors of its own
    proper = ancestors[node].clone()
    proper[node] = False
    candidates = proper.nonzero().squeeze(1)
    return int(candidates[ancestors[candidates].sum(-1).argmax()])


def test_rerank_keeps_trees_prefix_closed():
    # one row, pool grown depth by depth; a child ties its parent (draft probability 1) and must rank after it
    pool = _Pool(tokens=torch.tensor([[10, 11, 20, 21, 22, 23, 30]]),
                 scores=torch.tensor([[-0.1, -0.5, -0.1, -0.2, -0.9, -3.0, -0.3]]),
                 parents=torch.tensor([[-1, -1, 0, 0, 1, 1, 2]]),
                 depths=torch.tensor([[1, 1, 2, 2, 2, 2, 3]]))
    tree = _tree_from_pool(pool, torch.tensor([7]), total_tokens=4)
    assert tree.tokens.tolist() == [[7, 10, 20, 21, 30]]  # -0.1, -0.1 (the tie, after its parent), -0.2, -0.3
    assert tree.depths.tolist() == [[0, 1, 2, 2, 3]]
    assert tree.child_table[0].tolist() == [[1, -1], [2, 3], [4, -1], [-1, -1], [-1, -1]]
    assert tree.ancestors[0, 4].tolist() == [True, True, True, False, True]
    assert tree.depth == 3
    whole = _tree_from_pool(pool, torch.tensor([7]), total_tokens=100)  # more than the pool: all of it
    assert whole.num_nodes == 8 and whole.child_table[0, 2].tolist() == [5, 6]


def test_trees_accept_more_per_forward_than_chains():
    model = model_for("llama")
    prompts = own_text(model)[:4, :8]  # the text the head was trained on
    expected = model.generate(prompts, max_new_tokens=32, do_sample=False, pad_token_id=PAD)
    found = {}
    for name, tree in (("chain", None), ("tree", EagleTree(total_tokens=12, depth=5, top_k=4))):
        stats = SpeculativeStats()
        got = model.generate(prompts, max_new_tokens=32, do_sample=False, pad_token_id=PAD,
                             custom_generate=eagle_generate, eagle_head=trained_head(model), eagle_tree=tree,
                             eagle_stats=stats)
        assert torch.equal(got, expected), name
        found[name] = stats.tokens_per_forward
    assert found["tree"] > found["chain"] + 0.2, found


def test_bad_input():
    model = model_for("llama")
    one, two = make_prompts([6], seed=2), make_prompts([6, 4], seed=2)
    with pytest.raises(TypeError, match="eagle_tree"):
        run(model, one, eagle_tree={"total_tokens": 8})
    for name, value in (("total_tokens", 0), ("depth", -1), ("top_k", 2.5), ("top_k", True)):
        with pytest.raises(ValueError, match=name):
            EagleTree(**{name: value})
    with pytest.raises(ValueError, match="eagle_tree.*DynamicCache"):
        run(model, two, eagle_tree=TREE, cache_implementation="paged")
    with pytest.raises(ValueError, match="past_key_values"):
        run(model, one, eagle_tree=TREE, cache_implementation="sink")
