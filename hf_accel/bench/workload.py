"""The serving benchmarks' request mix (`serving_requests`), the two ways they are answered in one process
(`sequential_outputs`: one `generate` per request, the reference; `engine_outputs`: `hf_accel.Engine.generate`), and
how two answers to the same requests are compared (`compare_outputs`).

Rules: every request is greedy and generates exactly its `max_tokens` (EOS ignored); prompt plus output always fits
`max_len`; the same arguments give the same requests (a seeded `random.Random`), and the first `n` requests of a mix
are the same whatever `num_requests` is asked for beyond them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import reference
from ..engine.engine import Engine
from ..engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Request:
    """One greedy request: its prompt's token ids and the number of tokens it generates."""

    prompt: list[int]
    max_tokens: int


def serving_requests(tokenizer: PreTrainedTokenizerBase, num_requests: int, prompt_range: tuple[int, int],
                     max_tokens_range: tuple[int, int], max_len: int, seed: int = 0) -> list[Request]:
    """Held-out prompts (`reference.held_out_sequences`) of lengths drawn from `prompt_range`, each with a
    `max_tokens` drawn from `max_tokens_range` and capped so that prompt plus output fits `max_len` (inclusive
    ranges)."""
    rng = random.Random(seed)
    rows = reference.held_out_sequences(tokenizer, seq_len=prompt_range[1], max_rows=num_requests)
    requests = []
    for i in range(num_requests):
        length = rng.randint(*prompt_range)
        top = min(max_tokens_range[1], max_len - length)
        requests.append(Request(rows[i % len(rows), :length].tolist(), rng.randint(max_tokens_range[0], top)))
    return requests


def sequential_outputs(model: PreTrainedModel, work: list[Request]) -> list[list[int]]:
    """Each request's generated token ids from its own greedy `generate` call (exactly `max_tokens` of them)."""
    outputs = []
    for req in work:
        ids = torch.tensor([req.prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_tokens,
                             min_new_tokens=req.max_tokens, do_sample=False)
        outputs.append(out[0, len(req.prompt):].tolist())
    return outputs


def engine_outputs(engine: Engine, work: list[Request]) -> list[list[int]]:
    """Each request's generated token ids from one `engine.generate` call over all of them (greedy, EOS ignored)."""
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in work]
    return [out.token_ids for out in engine.generate([r.prompt for r in work], params)]


def compare_outputs(model: PreTrainedModel, work: list[Request], got: list[list[int]],
                    expected: list[list[int]]) -> dict[str, Any]:
    """Exact matches, and for the others the top-2 logit gap of `model` at the first difference (a near tie flips
    either way between batched and one-row matmuls)."""
    gaps = []
    for req, a, b in zip(work, got, expected, strict=True):
        if a != b:
            step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            with torch.no_grad():
                top = model(torch.tensor([req.prompt + b[:step]])).logits[0, -1].float().topk(2).values
            gaps.append(float(top[0] - top[1]))
    return {"requests": len(work), "identical": len(work) - len(gaps), "first_difference_top2_gaps": gaps}
