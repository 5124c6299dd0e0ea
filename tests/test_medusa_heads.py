"""MedusaHeads (shapes, separate modules, save/load, validation), candidate trees (exact masks and positions), the
accepted-path cache operations (DynamicCache and PagedCache, exact), and the vLLM export (config, names, shapes)."""

import json

import pytest
import torch
from conformance import VOCAB_SIZE, make_model
from safetensors.torch import load_file
from torch import nn
from transformers import DynamicCache

from hf_accel.cache.paged import PagedCache
from hf_accel.export.vllm_medusa import export_vllm
from hf_accel.speculative.medusa_heads import MedusaConfig, MedusaHeads
from hf_accel.speculative.tree import DEFAULT_TREE, build_tree, sparse_tree, tree_attention_mask, tree_position_ids
from hf_accel.speculative.tree_cache import keep_tree_path

SMALL_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]  # nodes: root, (0,), (1,), (0,0), (0,1), (1,0), (0,0,0)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", torch.float32, "sdpa")


def test_heads_shapes_separate_modules_and_lm_head_init(model):
    heads = MedusaHeads.for_model(model, num_heads=3, num_layers=2)
    assert heads(torch.randn(2, 5, 64)).shape == (3, 2, 5, VOCAB_SIZE)
    pointers = [p.data_ptr() for p in heads.parameters()]
    assert len(pointers) == len(set(pointers)) == 3 * (2 * 2 + 1)  # no module repeated
    for head in heads.lm_heads:
        assert torch.equal(head.weight, model.get_output_embeddings().weight)
    hidden = torch.randn(4, 64)  # residual Linears start at zero: head k starts as the model's own lm_head
    assert torch.allclose(heads(hidden)[1], model.get_output_embeddings()(hidden))


def test_heads_compute_only_the_first_num_heads(model):
    heads = MedusaHeads.for_model(model, num_heads=3)
    with torch.no_grad():
        for block in heads.blocks:
            nn.init.normal_(block.layers[0].weight)  # heads that differ from each other
        hidden = torch.randn(2, 64)
        assert torch.equal(heads(hidden, num_heads=2), heads(hidden)[:2])
    for bad in (0, 4):
        with pytest.raises(ValueError, match="num_heads"):
            heads(hidden, num_heads=bad)


def test_stacked_heads_compute_what_the_heads_do(model):
    heads = MedusaHeads.for_model(model, num_heads=3, num_layers=2)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                nn.init.normal_(layer.weight, std=0.3)
                nn.init.normal_(layer.bias, std=0.3)
        hidden = torch.randn(5, 64)
        stacked = heads.stacked(2)
        assert stacked.num_heads == 2
        assert torch.allclose(stacked(hidden), heads(hidden, num_heads=2), atol=1e-5)
        assert torch.allclose(stacked(hidden, num_heads=1), heads(hidden, num_heads=1), atol=1e-5)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="num_heads"):
            heads.stacked(bad)
    with pytest.raises(ValueError, match="num_heads"):
        stacked(hidden, num_heads=3)


def test_save_load_round_trip(model, tmp_path):
    heads = MedusaHeads.for_model(model, num_heads=2)
    with torch.no_grad():
        heads.blocks[1].layers[0].weight.normal_()
    heads.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "medusa_config.json").read_text())
    assert config == {"num_heads": 2, "hidden_size": 64, "vocab_size": VOCAB_SIZE, "num_layers": 1,
                      "base_model_name_or_path": None, "base_model_type": "llama", "tree": None}
    loaded = MedusaHeads.from_pretrained(tmp_path)
    hidden = torch.randn(3, 64)
    assert torch.equal(loaded(hidden), heads(hidden))
    assert MedusaHeads.from_pretrained(tmp_path, dtype=torch.bfloat16).lm_heads[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("field", ["num_heads", "hidden_size", "vocab_size", "num_layers"])
def test_config_rejects_non_positive(field):
    values = {"num_heads": 2, "hidden_size": 8, "vocab_size": 16, "num_layers": 1} | {field: 0}
    with pytest.raises(ValueError, match=field):
        MedusaConfig(**values)


def test_check_compatible_names_the_mismatch(model):
    with pytest.raises(ValueError, match="medusa_heads.*hidden size"):
        MedusaHeads(MedusaConfig(2, 32, VOCAB_SIZE)).check_compatible(model)
    with pytest.raises(ValueError, match="medusa_heads.*vocab size"):
        MedusaHeads(MedusaConfig(2, 64, 99)).check_compatible(model)


def test_tree_structure_exact():
    tree = build_tree(list(reversed(SMALL_TREE)), num_heads=3)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert tree.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert tree.ancestors.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    logits = torch.tensor([[0.0, 5, 1, 3], [4, 0, 2, 1], [0, 0, 0, 9]])  # head 0 ranks 1, 3; head 1 ranks 0, 2
    assert tree.candidate_tokens(logits).tolist() == [1, 3, 0, 2, 0, 3]
    assert tree_position_ids(tree, 10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]


def test_tree_mask_exact_with_padding_and_window():
    tree = build_tree([(0,), (0, 0), (1,)], num_heads=2)  # root, (0,), (1,), (0, 0)
    prefix = torch.tensor([-1, 1, 2, 3])  # 4 cached keys, the first one padding; the root is at index 4
    full = tree_attention_mask(tree, prefix, root_position=4)
    assert full.int().tolist() == [
        [0, 1, 1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 0, 1, 0],
        [0, 1, 1, 1, 1, 1, 0, 1],
    ]
    windowed = tree_attention_mask(tree, prefix, root_position=4, sliding_window=2)  # keys with index > q - 2
    assert windowed.int().tolist() == [
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0, 1, 0],
        [0, 0, 0, 0, 0, 1, 0, 1],
    ]


@pytest.mark.parametrize("paths, message", [([], "empty"), ([(0, 1)], "parent"), ([(0,), (0,)], "twice"),
                                             ([(0,), (0, 0), (0, 0, 0)], "deeper"), ([()], "non-empty"),
                                             ([(-1,)], "non-empty")])
def test_bad_trees(paths, message):
    with pytest.raises(ValueError, match=f"medusa_tree.*{message}|{message}.*medusa_tree"):
        build_tree(paths, num_heads=2)


def test_sparse_tree_takes_the_likeliest_paths_and_heads_keep_it(model, tmp_path):
    rates = torch.tensor([[0.6, 0.2, 0.12], [0.5, 0.3, 0.1]])
    # path values: (0,) .6, (0,0) .3, (1,) .2, (0,1) .18, (2,) .12, (1,0) .1, (0,2) .06, ...
    assert sparse_tree(rates, 5) == [(0,), (0, 0), (1,), (0, 1), (2,)]
    assert build_tree(sparse_tree(rates, 9), num_heads=2).num_nodes == 10  # prefix-closed at every size
    heads = MedusaHeads.for_model(model, num_heads=2)
    heads.config.tree = sparse_tree(rates, 5)
    heads.save_pretrained(tmp_path)
    assert MedusaHeads.from_pretrained(tmp_path).config.tree == [(0,), (0, 0), (1,), (0, 1), (2,)]


def test_default_tree_is_valid_for_every_head_count():
    for num_heads in (1, 2, 3, 4):
        tree = build_tree([p for p in DEFAULT_TREE if len(p) <= num_heads], num_heads)
        assert tree.depth == num_heads


def _filled(cache, states):
    for layer_idx, (keys, values) in enumerate(states):
        cache.update(keys, values, layer_idx)
    return cache


def test_keep_tree_path_dynamic_and_paged_exact(model):
    # 6 prefix tokens, then a 5-node tree; keep nodes 0, 2, 3
    gen = torch.Generator().manual_seed(0)
    prefix = [(torch.randn(1, 2, 6, 16, generator=gen), torch.randn(1, 2, 6, 16, generator=gen)) for _ in range(2)]
    tree = [(torch.randn(1, 2, 5, 16, generator=gen), torch.randn(1, 2, 5, 16, generator=gen)) for _ in range(2)]
    for cache in (DynamicCache(), PagedCache(model.config, block_size=4)):
        _filled(_filled(cache, prefix), tree)
        keep_tree_path(cache, num_nodes=5, kept=torch.tensor([[0, 2, 3]]))
        assert cache.get_seq_length() == 9
        probe = [(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))] * 2
        for layer_idx in range(2):
            keys, values = cache.update(*probe[layer_idx], layer_idx)
            for got, ours, new in ((keys, prefix[layer_idx][0], tree[layer_idx][0]),
                                   (values, prefix[layer_idx][1], tree[layer_idx][1])):
                expected = torch.cat([ours, new[:, :, [0, 2, 3]], torch.zeros(1, 2, 1, 16)], dim=2)
                assert torch.equal(got, expected), type(cache).__name__


def test_keep_tree_path_per_row():
    # 2 rows, 3 prefix tokens, then a 5-node tree; row 0 keeps nodes 0, 2, 3; row 1 keeps 0, 1 and a hole (node 0)
    gen = torch.Generator().manual_seed(1)
    prefix = [(torch.randn(2, 2, 3, 8, generator=gen), torch.randn(2, 2, 3, 8, generator=gen))]
    tree = [(torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen))]
    cache = _filled(_filled(DynamicCache(), prefix), tree)
    kept = torch.tensor([[0, 2, 3], [0, 1, 0]])
    keep_tree_path(cache, num_nodes=5, kept=kept)
    for got, ours, new in ((cache.layers[0].keys, *[t[0] for t in (prefix[0], tree[0])]),
                           (cache.layers[0].values, *[t[1] for t in (prefix[0], tree[0])])):
        assert got.shape == (2, 2, 6, 8)
        for row in range(2):
            assert torch.equal(got[row], torch.cat([ours[row], new[row][:, kept[row]]], dim=1))


def test_tree_mask_per_row_prefix():
    tree = build_tree([(0,), (1,)], num_heads=1)
    prefix = torch.tensor([[0, 1, 2], [-1, 1, -1]])  # row 1: left padding, then a real token, then a hole
    allowed = tree_attention_mask(tree, prefix, root_position=3)
    assert allowed.shape == (2, 3, 6)
    assert allowed[0].int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]]
    assert allowed[1].int().tolist() == [[0, 1, 0, 1, 0, 0], [0, 1, 0, 1, 1, 0], [0, 1, 0, 1, 0, 1]]


def test_candidate_tokens_per_row():
    tree = build_tree([(0,), (1,), (0, 0)], num_heads=2)
    logits = torch.tensor([[[0.0, 5, 1, 3], [9, 0, 2, 1]], [[4, 0, 2, 1], [0, 0, 8, 9]]])  # [heads, rows, vocab]
    assert tree.candidate_tokens(logits).tolist() == [[1, 3, 0], [0, 2, 3]]  # (0,), (1,), (0, 0) per row


class VllmResidualBlock(nn.Module):
    """vLLM 0.10's Medusa ResidualBlock, rebuilt from its documented structure, to load the export into."""

    def __init__(self, hidden_size, num_layers, bias):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)])
        self.act = nn.SiLU()

    def forward(self, x):
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


def test_vllm_export_config_names_and_shapes(model, tmp_path):
    heads = MedusaHeads.for_model(model, num_heads=3, num_layers=2)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.normal_(0, 0.1)
    export_vllm(heads, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "architectures", "hidden_size", "vocab_size", "truncated_vocab_size",
                                   "num_heads", "num_hidden_layers", "medusa_fc_bias", "original_lm_head")} == {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 64, "vocab_size": VOCAB_SIZE,
        "truncated_vocab_size": VOCAB_SIZE, "num_heads": 3, "num_hidden_layers": 2, "medusa_fc_bias": True,
        "original_lm_head": False}
    tensors = load_file(tmp_path / "model.safetensors")
    expected = {f"blocks.{k}.layers.{j}.{p}": (64, 64) if p == "weight" else (64,)
                for k in range(3) for j in range(2) for p in ("weight", "bias")}
    expected |= {f"lm_heads.{k}.weight": (VOCAB_SIZE, 64) for k in range(3)}
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    vllm = nn.Module()
    vllm.blocks = nn.ModuleList([VllmResidualBlock(64, 2, config["medusa_fc_bias"]) for _ in range(3)])
    vllm.lm_heads = nn.ModuleList([nn.Linear(64, VOCAB_SIZE, bias=False) for _ in range(3)])
    vllm.load_state_dict(tensors, strict=True)
    hidden = torch.randn(5, 64)
    expected_logits = torch.stack([head(block(hidden)) for block, head in zip(vllm.blocks, vllm.lm_heads)])
    assert torch.allclose(heads(hidden), expected_logits, atol=1e-6)
