"""Eager speculative loops' Linears over packed panels (`hf_accel/kernels/eager_packing.py`): which Linears are
packed, results equal to `F.linear` up to rounding, the forwards removed however the context ends (and an engine's
panels kept between its steps, set only while one runs: `linear_panels.LinearPanels`), and the loops of
`eagle_generate`, `draft_generate`, `ngram_generate` and `medusa_generate` running their models' Linears through the
kernel (tokens equal to plain greedy are the loops' own tests)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import hf_accel
import hf_accel.kernels.eager_packing as packed_module
import hf_accel.kernels.linear_panels as panels_module
from hf_accel.kernels.packed_linear import pack_weight
from hf_accel.kernels.custom_ops import packed_linear_kernel
from hf_accel.kernels.eager_packing import packed_linears
from hf_accel.kernels.linear_panels import LinearPanels

pytestmark = pytest.mark.skipif(packed_linear_kernel() is None, reason="the hf_accel kernels could not be built here")


class _Scaled(nn.Linear):
    """A Linear subclass: its forward may do more than `F.linear`, so it is never packed."""


def _model(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def _patched(module: nn.Module) -> list[str]:
    return [name for name, sub in module.named_modules() if "forward" in sub.__dict__]


@torch.no_grad()
def test_eligible_linears_compute_over_panels_and_are_restored():
    torch.manual_seed(0)
    plain, bias_free, sub, half = nn.Linear(48, 40), nn.Linear(48, 33, bias=False), _Scaled(48, 40), nn.Linear(48, 40)
    half.to(torch.bfloat16)
    stack = nn.ModuleList([plain, bias_free, sub, half])
    x = torch.randn(2, 5, 48)
    expected = [plain(x), bias_free(x)]
    with packed_linears(stack, None, plain) as count:  # None skipped, a module named twice packed once
        assert count == 2 and set(_patched(stack)) == {"0", "1"}
        got = [plain(x), bias_free(x), plain(input=x[0]), plain(x.transpose(0, 1)), plain(x[:, :0])]
        assert sub(x).shape == (2, 5, 40) and half(x.bfloat16()).dtype == torch.bfloat16
    references = expected + [expected[0][0], expected[0].transpose(0, 1), expected[0][:, :0]]
    for value, reference in zip(got, references, strict=True):
        assert value.shape == reference.shape
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-5)
    assert _patched(stack) == []


@torch.no_grad()
def test_forwards_are_removed_when_the_body_raises():
    model = _model()
    with pytest.raises(RuntimeError, match="stop"), packed_linears(model) as count:
        assert count == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
        raise RuntimeError("stop")
    assert _patched(model) == []


@torch.no_grad()
def test_forwards_are_removed_when_packing_fails_part_way(monkeypatch):
    model, calls = _model(), []

    def failing(weight):
        calls.append(weight.shape)
        if len(calls) == 5:
            raise MemoryError("no room for panels")
        return pack_weight(weight)

    monkeypatch.setattr(panels_module, "pack_weight", failing)
    with pytest.raises(MemoryError), packed_linears(model):
        pass
    assert len(calls) == 5 and _patched(model) == []


def test_nothing_is_packed_with_gradients_on_or_a_forward_already_replaced():
    model = _model()
    with packed_linears(model) as count:  # gradients on: the op has no backward
        assert count == 0
    hooked = model.model.layers[0].mlp.down_proj
    hooked.forward = lambda x: torch.zeros(x.shape[:-1] + (64,))  # as accelerate's hooks replace it
    with torch.no_grad(), packed_linears(model) as count:
        assert count == 2 * 7  # all but the replaced one
        assert hooked.forward(torch.ones(1, 128)).abs().sum() == 0
    assert _patched(model) == ["model.layers.0.mlp.down_proj"]


@torch.no_grad()
def test_nothing_is_packed_without_the_kernel_or_when_switched_off(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(packed_module, "packed_linear_kernel", lambda: None)
        with packed_linears(_model()) as count:
            assert count == 0
    monkeypatch.setenv("HF_ACCEL_PACKED_LINEARS", "0")
    with packed_linears(_model()) as count:
        assert count == 0


@torch.no_grad()
def test_nothing_is_packed_where_the_panels_would_not_fit_in_memory(monkeypatch):
    model = _model()
    needed = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    memory = type("Memory", (), {"available": needed})  # the panels would take all of it
    monkeypatch.setattr(packed_module.psutil, "virtual_memory", lambda: memory)
    with pytest.warns(UserWarning, match="GiB available"), packed_linears(model) as count:
        assert count == 0
    memory.available = 2 * needed
    with packed_linears(model) as count:
        assert count == 2 * 7 + 1


class _Marked(torch.Tensor):
    """A tensor subclass weight (as torchao's quantized weights are): its matmul is its own."""


@torch.no_grad()
def test_nothing_is_packed_under_autocast_in_a_compiled_tree_or_for_a_subclass_weight():
    model = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(model) as count:
        assert count == 0  # F.linear would return bf16 there
    compiled = _model()
    compiled.model.layers[1].compile()  # dynamo would trace the replaced forwards and recompile every call
    with packed_linears(compiled) as count:
        assert count == 0 and _patched(compiled) == []
    wrapped = _model()
    wrapped.forward = torch.compile(wrapped.forward)
    with packed_linears(wrapped) as count:
        assert count == 0
    marked = _model()
    gate = marked.model.layers[0].mlp.gate_proj
    gate.weight = nn.Parameter(torch.Tensor._make_subclass(_Marked, gate.weight.detach()), requires_grad=False)
    with packed_linears(marked) as count:
        assert count == 2 * 7 and "forward" not in gate.__dict__


@torch.no_grad()
def test_a_forward_set_during_the_call_is_left_in_place():
    model = _model()
    linear = model.model.layers[0].self_attn.q_proj

    def hooked(x):  # as accelerate's add_hook_to_module replaces a forward it wraps
        return torch.zeros(x.shape[:-1] + (64,))

    with packed_linears(model):
        linear.forward = hooked
    assert linear.__dict__["forward"] is hooked and len(_patched(model)) == 1


def _counting_kernel(monkeypatch, watched: nn.Linear) -> list[int]:
    """Rows of each call to the packed op over `watched`'s weight, recorded while the real kernel computes it."""
    kernel, rows = packed_linear_kernel(), []

    def counted(x, panels, weight, bias):
        if weight.data_ptr() == watched.weight.data_ptr():
            rows.append(x.shape[0])
        return kernel(x, panels, weight, bias)

    monkeypatch.setattr(packed_module, "packed_linear_kernel", lambda: counted)
    return rows


def _generate(model: LlamaForCausalLM, **kwargs) -> torch.Tensor:
    prompt = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 14, 22, 31, 5, 9]])
    return model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)


@pytest.mark.parametrize("method", ["eagle", "draft", "ngram", "medusa"])
def test_speculative_loops_run_their_linears_packed(monkeypatch, method):
    model = _model()
    plain = _generate(model)
    kwargs = {
        "eagle": lambda: {"custom_generate": hf_accel.eagle_generate,
                          "eagle_head": hf_accel.EagleHead.for_model(model).eval()},
        "draft": lambda: {"custom_generate": hf_accel.draft_generate, "draft_model": _model(seed=1, layers=1)},
        "ngram": lambda: {"custom_generate": hf_accel.ngram_generate},
        "medusa": lambda: {"custom_generate": hf_accel.medusa_generate,
                           "medusa_heads": hf_accel.MedusaHeads.for_model(model, num_heads=2).eval()},
    }[method]()
    rows = _counting_kernel(monkeypatch, model.model.layers[0].self_attn.q_proj)  # one per target forward
    out = _generate(model, **kwargs)
    assert torch.equal(out, plain)
    assert rows[0] == 13 and max(rows[1:]) > 1  # the prefill, then verify forwards of several rows
    assert _patched(model) == [] and all(_patched(v) == [] for v in kwargs.values() if isinstance(v, nn.Module))


@torch.no_grad()
def test_kept_panels_are_set_only_while_installed_however_entries_nest():
    model = _model()
    input_ids = torch.tensor([[3, 14, 15, 9, 2]])
    expected = model(input_ids).logits
    panels = LinearPanels.pack(model)
    assert panels is not None and len(panels.forwards) == 2 * 7 + 1 and _patched(model) == []
    with panels.installed():
        with panels.installed():  # a step beside a background compile
            assert len(_patched(model)) == 15
        assert len(_patched(model)) == 15  # the outer entry keeps them
        torch.testing.assert_close(model(input_ids).logits, expected, rtol=1e-4, atol=1e-4)
    assert _patched(model) == []
    with pytest.raises(RuntimeError), panels.installed():
        raise RuntimeError("a step failed")
    assert _patched(model) == []
