"""`draft_generate` with `compile_config`: the draft's forwards and the target's verify forward, all compiled.

The drafter (the draft model) gets its own static paged pool, prefilled with the prompts. A round of k candidates
per row (k from `DraftLength`, as in the eager loop, but never 0 by choice):
- one compiled draft forward of 2 tokens per row, the token before the last and the last (positions `p - 1`, `p`):
  a row that accepted every candidate last round never fed the draft its final candidate, and feeding the pair always
  gives every row the same shape (rewriting a K/V that was already right costs nothing extra);
- k - 1 compiled single-token draft steps, each on the previous draft token;
- the target's compiled verify forward of the last token and the k candidates (`target_rounds.TargetRounds`).
Draft K/V past a row's accepted tokens are overwritten next round (rollback by position in both pools). Candidates
stay on the device until the verify's outcome is read: one host synchronisation per round. Greedy output equals
plain greedy `generate`. Sampling (temperature / top-k / top-p / min-p) is lossless as in the eager loop: the draft's
compiled forwards return their logits, each draft is drawn from the draft's warped distribution (`token_choice.draw`,
outside the graph), and the target accepts by speculative sampling against those distributions. On a GPU with a
mode that asks for CUDA graphs, each of the draft's forwards and the target's is a captured graph per input shape
once that shape recurs (`captured_step.CapturedSteps`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..registry import attention_implementation
from ..runtime.attention import ATTENTION_NAME
from ..speculative.chain_checks import check_draft_vocabulary
from ..speculative.decoding import GenerateCall
from ..speculative.draft import DraftOptions
from ..speculative.draft_length import DraftLength
from .captured_step import CapturedSteps, captures
from .paged_rows import PagedRows
from .step import compiled_decode_step, compiled_verify_step
from .target_rounds import TargetRounds, decode_forward, pool_for, prefill, verify_forward
from .token_choice import draw


@dataclass(frozen=True, slots=True)
class DraftSteps:
    """The draft's compiled forwards over its pool (`step.compiled_verify_step`, `compiled_decode_step`), each
    `(tokens, positions) -> tensor`: `pair`, `[rows, 2]` tokens from `positions` -> `[rows, 2]` next tokens (sampling:
    `[rows, 2, vocab]` logits); `step`, `[rows]` tokens -> `[rows]` next tokens (sampling: `[rows, vocab]` logits)."""

    pair: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @classmethod
    def compile(cls, draft: PreTrainedModel, pool: PagedRows, target: TargetRounds,
                config: GenerationConfig) -> DraftSteps:
        """The draft's steps compiled with `config.compile_config`, captured in CUDA graphs where its mode asks."""
        decode = compiled_decode_step(config.compile_config, draft)
        verify = compiled_verify_step(config.compile_config, draft)
        attends, sampled = target.attends, target.do_sample
        captured = captures(pool.device, config.compile_config.mode)
        # drafts are drawn outside the graphs when sampling: the forwards return logits then
        return cls(CapturedSteps(functools.partial(verify_forward, verify, draft, pool, attends.verify, (), sampled),
                                 captured),
                   CapturedSteps(functools.partial(decode_forward, decode, draft, pool, attends.decode, (), False,
                                                   sampled), captured))


def compiled_draft_generate(call: GenerateCall,
                            options: DraftOptions) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Draft-model speculation with compiled forwards (see the module docstring), greedy or (with `do_sample`)
    sampled after the call's warpers; returns what `generate` returns."""
    draft = options.draft_model
    length = DraftLength(options.num_draft_tokens, options.max_draft_tokens, allow_off=False)
    check_draft_vocabulary(call.model, draft)
    target = TargetRounds(call, length.max_tokens, options.draft_stats)
    pool = pool_for(draft, target.prompts, target.outputs.max_new_tokens, length.max_tokens, call.generation_config)
    steps = DraftSteps.compile(draft, pool, target, call.generation_config)
    return target.run(lambda: _round(target, steps, length),
                      lambda: prefill(draft, pool, target.prompts, target.attends.prefill),
                      (attention_implementation(draft, ATTENTION_NAME),))


def _round(target: TargetRounds, draft: DraftSteps, length: DraftLength) -> None:
    """Draft k candidates per row, verify them, adapt k. Where no row may gain two tokens (the last round) the round
    still verifies one candidate, counted as none, so that no target decode-step graph is compiled for that one
    token."""
    started, generating = time.perf_counter(), [not done for done in target.outputs.finished]
    remaining = [left for left, on in zip(target.outputs.remaining, generating) if on]
    k = length.next(max(remaining), len(generating))
    counts = None if k else torch.zeros_like(target.positions)  # the last round: its one draft counts as none
    candidates, draft_probs = _draft(target, draft, max(k, 1))
    accepted = target.verify_round(candidates, counts, draft_probs)
    if k:
        target.stats.num_draft_forwards += k
        length.update(k, [n for n, on in zip(accepted, generating) if on], len(generating),
                      time.perf_counter() - started, remaining)


def _draft(target: TargetRounds, draft: DraftSteps, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[rows, k]` candidates: a 2-token forward (the token before the last, the last), then k - 1 steps; when
    sampling, also the `[rows, k, vocab]` distributions they were drawn from (else None)."""
    positions, sampled = target.positions, target.do_sample
    pair = torch.stack([target.previous, target.last], dim=1)  # [rows, 2] at positions - 1, positions
    first = draft.pair(pair, positions - 1)[:, 1]
    drafts = [draw(first, target.warpers) if sampled else (first, None)]
    for j in range(1, k):
        out = draft.step(drafts[-1][0], positions + j)
        drafts.append(draw(out, target.warpers) if sampled else (out, None))
    tokens = torch.stack([token for token, _ in drafts], dim=1)
    return tokens, torch.stack([probs for _, probs in drafts], dim=1) if sampled else None
