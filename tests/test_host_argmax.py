"""`argmax_rows` picks the token torch's argmax picks, for every input the host loops can hand it."""

from __future__ import annotations

import pytest
import torch

from hf_accel.runtime.host_argmax import argmax_rows


def _scores(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Few distinct values (many ties), some NaN and -inf, one row all -inf."""
    generator = torch.Generator().manual_seed(len(shape))
    scores = torch.randint(0, 4, shape, generator=generator).to(dtype)
    flat = scores.view(-1)
    flat[::97] = float("nan")
    flat[1::13] = float("-inf")
    scores.view(-1, shape[-1])[-1] = float("-inf")
    return scores


@pytest.mark.parametrize("shape", [(4096,), (3, 4096), (2, 5, 300), (64, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_choice_is_torch_argmax(shape, dtype):
    scores = _scores(shape, dtype)
    for view in (scores, scores.transpose(0, -1).contiguous().transpose(0, -1)):  # and strided rows
        got, want = argmax_rows(view), view.argmax(dim=-1)
        assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want)


def test_a_graph_traces_torch_argmax():
    scores = _scores((8, 512))
    compiled = torch.compile(lambda x: argmax_rows(x * 2), backend="eager", fullgraph=True)
    assert torch.equal(compiled(scores), (scores * 2).argmax(dim=-1))


def test_inputs_numpy_cannot_take_keep_torch():
    scores = _scores((4, 64)).requires_grad_()
    assert torch.equal(argmax_rows(scores), scores.argmax(dim=-1))
    assert argmax_rows(torch.zeros(0, 5)).shape == (0,)
    assert int(argmax_rows(torch.tensor([1.0, 3.0, 3.0]))) == 1


def test_traces_and_views_numpy_cannot_read_keep_torch():
    scores = _scores((2, 64))
    traced = torch.jit.trace(lambda x: argmax_rows(x), (scores,), check_trace=False)
    other = _scores((2, 64)).flip(-1)
    assert torch.equal(traced(other), other.argmax(dim=-1))  # not the traced input's answer baked in
    negated = torch._neg_view(scores)
    assert torch.equal(argmax_rows(negated), negated.argmax(dim=-1))
