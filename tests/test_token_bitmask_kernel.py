"""Structured outputs' mask kernel (`torch.ops.hf_accel.apply_token_bitmask`, csrc/token_bitmask.cpp) sets exactly
the logits xgrammar's own CPU kernel sets: sparse, dense and random bitmasks, a vocabulary that is not a multiple of
32 and one wider than the bitmask, fp32 / bf16 / fp16, strided rows, only the indexed rows; `apply_bitmask` takes it
on the CPU and xgrammar's kernel where it is not built. The greedy choice under a mask
(`torch.ops.hf_accel.masked_argmax`, `matcher.argmax_allowed`) is the argmax of the masked logits: ties, NaN, rows
whose every allowed logit is -inf, unmasked rows, with and without the kernel."""

import pytest
import torch

from hf_accel.kernels.custom_ops import masked_argmax_kernel, token_bitmask_kernel
from hf_accel.structured import matcher

xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(token_bitmask_kernel() is None, reason="hf_accel's C++ extension is not built")


def bitmasks(rows: int, words: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 1000 + words)
    sparse = torch.zeros(rows, words, dtype=torch.int32)
    sparse[:, words // 2] = 0b1011  # a few tokens allowed, the JSON-punctuation case
    dense = torch.full((rows, words), -1, dtype=torch.int32)
    dense[:, 0] = 0x7FFFFFF0  # a few forbidden
    random = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    return {"sparse": sparse, "dense": dense, "random": random}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(1, 4096), (3, 1000), (8, 32001), (33, 130)])
def test_the_kernel_masks_what_xgrammars_kernel_masks(rows, vocab, dtype):
    words = (vocab + 31) // 32
    for name, bitmask in bitmasks(rows, words).items():
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype)
        expected, actual = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask)
        token_bitmask_kernel()(actual, bitmask, torch.arange(rows))
        assert torch.equal(actual, expected), name
        assert bool(torch.isinf(actual).any()) and not bool(torch.isinf(actual).all()), name


def test_only_indexed_rows_strided_logits_and_a_wider_vocabulary():
    bitmask = bitmasks(4, 4)["random"]  # covers 128 tokens
    wide = torch.randn(4, 300)
    logits = wide[:, :200]  # rows strided by 300; 72 tokens past the bitmask
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=128, indices=[1, 3])
    token_bitmask_kernel()(logits, bitmask, torch.tensor([1, 3]))
    assert torch.equal(logits, expected)
    assert not bool(torch.isinf(logits[[0, 2]]).any()) and not bool(torch.isinf(logits[:, 128:]).any())
    assert not bool(torch.isinf(wide[:, 200:]).any())  # nothing written past the view


def test_bad_arguments_are_refused():
    kernel = token_bitmask_kernel()
    with pytest.raises(RuntimeError, match="int32"):
        kernel(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="indices"):
        kernel(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([1]))


def test_apply_bitmask_uses_the_kernel_and_falls_back_to_xgrammar(monkeypatch):
    bitmask = bitmasks(2, 8)["random"]
    logits = torch.randn(2, 256)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[1])
    calls = []
    kernel = token_bitmask_kernel()
    monkeypatch.setattr(matcher, "token_bitmask_kernel", lambda: lambda *args: calls.append(kernel(*args)))
    ours = logits.clone()
    matcher.apply_bitmask(ours, bitmask, [1])
    assert calls and torch.equal(ours, expected)
    monkeypatch.setattr(matcher, "token_bitmask_kernel", lambda: None)  # not built: xgrammar's kernel
    theirs = logits.clone()
    matcher.apply_bitmask(theirs, bitmask, [1])
    assert torch.equal(theirs, expected)


def hard_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits with what an argmax must get right: ties (rounded values), -inf runs, a NaN, an all -inf row."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 2).round()
    logits[torch.rand(rows, vocab, generator=generator) < 0.3] = float("-inf")
    logits[0, vocab // 3] = float("nan")
    logits[-1] = float("-inf")
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(1, 4096), (3, 1000), (8, 32001), (33, 130)])
def test_masked_argmax_chooses_what_an_argmax_of_the_masked_logits_chooses(rows, vocab, dtype):
    words = (vocab + 31) // 32
    for seed, (name, bitmask) in enumerate(bitmasks(rows, words).items()):
        for logits in (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype),
                       hard_logits(rows, vocab, dtype, seed)):
            indexed = list(range(0, rows, 2))  # the other rows: a plain argmax
            masked = logits.clone()
            token_bitmask_kernel()(masked, bitmask, torch.tensor(indexed))
            expected = masked.float().argmax(dim=-1)
            before = logits.clone()
            actual = masked_argmax_kernel()(logits, bitmask, torch.tensor(indexed))
            assert torch.equal(actual, expected), name
            assert torch.equal(logits.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               before.view(torch.int16 if dtype != torch.float32 else torch.int32))  # unwritten


def test_masked_argmax_past_a_narrower_bitmask_and_on_strided_rows():
    bitmask = torch.zeros(2, 4, dtype=torch.int32)  # covers 128 tokens, allows none: the best past them wins
    wide = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    logits = wide[:, :200]
    assert masked_argmax_kernel()(logits, bitmask, torch.tensor([0, 1])).tolist() == \
        (logits[:, 128:].argmax(dim=-1) + 128).tolist()
    with pytest.raises(RuntimeError, match="indices"):
        masked_argmax_kernel()(logits, bitmask, torch.tensor([2]))


def test_argmax_allowed_with_and_without_the_kernel(monkeypatch):
    bitmask = bitmasks(3, 8)["random"]
    logits = hard_logits(3, 256, torch.float32, 7)
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask, indices=[0, 2])
    expected = masked.argmax(dim=-1)
    assert torch.equal(matcher.argmax_allowed(logits, bitmask, [0, 2]), expected)
    assert torch.equal(matcher.argmax_allowed(logits, None, []), logits.argmax(dim=-1))
    monkeypatch.setattr(matcher, "masked_argmax_kernel", lambda: None)  # not built: the mask on a copy
    before = logits.clone()
    assert torch.equal(matcher.argmax_allowed(logits, bitmask, [0, 2]), expected)
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())
