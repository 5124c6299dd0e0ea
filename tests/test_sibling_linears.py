"""Sibling quantized Linears (q / k / v, gate / up) share one buffer of panels after loading, and compiled generate
runs each group as one kernel call (`quant/sibling_linears.py`): the same tokens as unmerged graphs and as eager, the
same state_dict, and a save / load round trip."""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch._inductor.config as inductor_config
from conformance import PAD, make_model, make_prompts
from torch._inductor.custom_graph_pass import CustomGraphPass
from transformers import CompileConfig

from hf_accel import WeightOnlyConfig, load_model, quantize_model
from hf_accel.kernels.custom_ops import quantized_linear_kernels
from hf_accel.quant.sibling_linears import colocate_siblings

pytestmark = pytest.mark.skipif(quantized_linear_kernels() is None, reason="hf_accel's quantized kernels not built")


class _NoMerge(CustomGraphPass):
    """Stands in the pass's place, so that a graph compiles unmerged."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> bytes:
        return b"no-merge"


def quantized(bits: int):
    return quantize_model(make_model("llama", torch.float32, "sdpa"), WeightOnlyConfig(bits=bits))


def shares_storage(*tensors: torch.Tensor) -> bool:
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1


@pytest.mark.parametrize("bits", [8, 4])
def test_siblings_lie_end_to_end_and_keep_their_state_dict(bits):
    model = quantized(bits)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert shares_storage(q, k, v) and shares_storage(mlp.gate_proj.weight, mlp.up_proj.weight)
    assert k.storage_offset() == q.storage_offset() + q.numel()
    if bits == 4:
        assert shares_storage(attention.q_proj.weight_qpanels, attention.v_proj.weight_qpanels)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert colocate_siblings(model) == 2 * len(model.model.layers)  # again: the same groups, the same values
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.compiled
@pytest.mark.parametrize("bits", [8, 4])
def test_merged_graphs_give_the_unmerged_tokens(bits):
    inputs = make_prompts([9, 17], seed=3)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, cache_implementation="paged")
    merged_model, plain_model = quantized(bits), quantized(bits)
    dynamo_utils.counters["hf_accel"].clear()
    with inductor_config.patch(fx_graph_cache=False):  # a graph from the cache would skip the pass and its count
        merged = merged_model.generate(**inputs, compile_config=CompileConfig(fullgraph=True), **kwargs)
    layers = len(merged_model.model.layers)
    assert dynamo_utils.counters["hf_accel"]["merged_linears"] >= 5 * layers  # q, k, v and gate, up per layer
    with inductor_config.patch(post_grad_custom_pre_pass=_NoMerge()):
        plain = plain_model.generate(**inputs, compile_config=CompileConfig(fullgraph=True), **kwargs)
    assert torch.equal(merged, plain)  # each column is computed alone: the same bits
    assert torch.equal(merged, merged_model.generate(**inputs, **kwargs))  # and eager's tokens


def test_a_saved_model_loads_with_its_siblings_colocated(tmp_path):
    model = quantized(4)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    attention = loaded.model.layers[0].self_attn
    assert shares_storage(attention.q_proj.weight, attention.k_proj.weight)
    inputs = make_prompts([11], seed=1)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    assert torch.equal(loaded.generate(**inputs, **kwargs), model.generate(**inputs, **kwargs))
