"""`eagle_generate` with `compile_config`: the target's verify forward and the head's passes, all compiled.

The target runs as in the other compiled speculative loops (`target_rounds.TargetRounds`: a static paged pool, rows at
their own positions, rollback by position), and its prefill and verify forwards also return the hidden states the
head fuses. The head gets a static paged pool of its own (one layer, the same block layout), attended by the same
paged attention op, and keeps the eager loop's entry rule (`speculative/eagle_draft.py`): the entry at position t
pairs the target's feature at t with the token at t + 1, and its output predicts the token at t + 2. A round, row
`r` with its last token at position `p`:
- the head's output at entry `p - 1` (kept from the last pass) gives draft 1; each further draft is one compiled
  head pass of one entry per row (the head's own output, the draft just chosen) at `p + j`, until k drafts or no
  generating row's head gave its draft at least `min_draft_probability` (the eager loop's early end);
- the target's compiled verify forward of the last token and the drafts (positions `p .. p + k`) accepts `a_r`;
- one compiled head pass writes entries `p .. p + k` (the verify's features, and the target's own next token at each
  position, which is the true next token up to `p + a_r + 1`) and keeps its output at `p + a_r`: the next round's
  draft 1. Entries past it, and the draft entries, are overwritten before any query can read them.
Greedy output equals plain greedy `generate`. Sampling (temperature, top-k, top-p, min-p, applied in the graphs)
draws each draft from the head's warped distribution and accepts by lossless speculative sampling against it, as
the eager loop does; the entry tokens are then the sampled tokens, accepted drafts and the resampled one.
On a GPU with a mode that asks for CUDA graphs, the verify forward and each kind of head pass are captured graphs,
one per input shape once it recurs (`captured_step.CapturedSteps`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..runtime.attention import ATTENTION_NAME, StepAttention
from ..speculative.decoding import GenerateCall
from ..speculative.draft_length import DraftLength
from ..speculative.eagle import EagleOptions
from ..speculative.eagle_head import EagleHead, token_embeddings
from .captured_step import CapturedSteps, captures
from .paged_rows import PagedRows, table_slots
from .step import compiled_with
from .target_rounds import TargetRounds, pool_for


def head_pass(model: PreTrainedModel, head: EagleHead, features: torch.Tensor, tokens: torch.Tensor,
              positions: torch.Tensor, kv, block_table: torch.Tensor, attend: Callable, pick: torch.Tensor,
              fuse: bool, warpers: tuple, do_sample: bool) -> HeadOutput:
    """Row `r` writes `n` head entries (`features[r, i]`, `tokens[r, i]`), `[rows, n, F]` / `[rows, n]`, at
    positions `positions[r] + i` of the head's pool (`fuse`: F is the target's concatenated features, else the head's
    own output, F = H) -> the head's draft from its output at entry `pick[r]` of each row (`readout`)."""
    hidden = picked_output(model, head, features, tokens, positions, kv, block_table, attend, pick, fuse)
    return readout(model, head, hidden, warpers, do_sample)


def picked_output(model: PreTrainedModel, head: EagleHead, features: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, kv, block_table: torch.Tensor, attend: Callable, pick: torch.Tensor,
                  fuse: bool) -> torch.Tensor:
    """`head_pass`'s entries written -> the head's output at entry `pick[r]` of each row, `[rows, H]`."""
    rows, num = tokens.shape
    at = positions[:, None] + torch.arange(num, device=positions.device)  # [rows, n]
    slots = table_slots(block_table, at, kv.block_size).reshape(-1)
    query_start = torch.arange(rows + 1, device=positions.device) * num
    attention = StepAttention(kv, slots, block_table, query_start, positions + num, attend)
    out = head_entries(model, head, features.reshape(1, rows * num, -1), tokens.reshape(1, -1), at.reshape(1, -1),
                       attention, fuse)
    return out[0].view(rows, num, -1).gather(1, pick[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]


def head_entries(model: PreTrainedModel, head: EagleHead, features: torch.Tensor, tokens: torch.Tensor,
                 positions: torch.Tensor, attention: StepAttention, fuse: bool) -> torch.Tensor:
    """The head over packed entries `[1, total, F]` / `[1, total]` at `positions` `[1, total]`, attending through
    `attention` -> outputs `[1, total, H]`."""
    if fuse:
        features = head.fc(features.to(head.dtype))
    return head(features, token_embeddings(model, tokens), positions, None, None, hf_accel_step=attention)


def readout(model: PreTrainedModel, head: EagleHead, hidden: torch.Tensor, warpers: tuple,
            do_sample: bool) -> HeadOutput:
    """The head's draft from `hidden` `[rows, H]` through its norm and the target's LM head: greedy, or drawn
    (exponential race) from the distribution after `warpers`; with the probability the head gave it."""
    scores = head.logits(model, hidden)
    for warper in warpers:
        scores = warper(None, scores)  # in-graph warpers never read input_ids
    probs = torch.softmax(scores, dim=-1)
    token = (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1) if do_sample else probs.argmax(dim=-1)
    confidence = probs.gather(1, token[:, None])[:, 0]
    return HeadOutput(hidden, token, confidence, probs if do_sample else None)


def _head_pass_outputs(step: Callable[..., HeadOutput], model: PreTrainedModel, head: EagleHead, pool: PagedRows,
                       attend: Callable, fuse: bool, warpers: tuple, do_sample: bool, features: torch.Tensor,
                       tokens: torch.Tensor, positions: torch.Tensor, pick: torch.Tensor) -> tuple:
    """The compiled head pass `step` over `pool` (`head_pass`'s arguments) -> its `HeadOutput`'s fields, a tuple (what
    a captured graph returns)."""
    out = step(model, head, features, tokens, positions, pool.kv, pool.block_table, attend, pick, fuse, warpers,
               do_sample)
    return out.hidden, out.token, out.confidence, out.probs


def compiled_head_pass(config: CompileConfig, head: EagleHead, model: PreTrainedModel) -> Callable[..., HeadOutput]:
    """`head_pass` compiled for `head` and its target `model` (on CPU their weights are frozen into the graphs, kept
    while neither changes)."""
    return compiled_with(config, head, head_pass, companions=(model,))


@dataclass(slots=True)
class HeadOutput:
    """The head's draft per row: the hidden state it came from `[rows, H]`, the token `[rows]`, the probability the
    head gave it `[rows]`, and (sampling) the distribution it was drawn from `[rows, vocab]`."""

    hidden: torch.Tensor
    token: torch.Tensor
    confidence: torch.Tensor
    probs: torch.Tensor | None


@dataclass(slots=True)
class HeadRounds:
    """The head's pool and compiled pass, the decoding rule (`warpers`, `do_sample`), and the draft its last pass
    left (`last`: draft 1 of the next round); `captured`: the passes are captured in CUDA graphs (`draft_pass`, one
    entry per row on the head's own output; `catch_up_pass`, the verify's entries over the target's features)."""

    model: PreTrainedModel
    head: EagleHead
    pool: PagedRows
    attend: Callable
    step: Callable[..., HeadOutput]
    min_probability: float
    warpers: tuple = ()
    do_sample: bool = False
    last: HeadOutput | None = None
    captured: bool = False
    draft_pass: CapturedSteps = field(init=False)
    catch_up_pass: CapturedSteps = field(init=False)

    def __post_init__(self) -> None:
        # the passes hold what they read, not `self` (no reference cycle keeping the pool and graphs alive)
        reads = (self.step, self.model, self.head, self.pool, self.attend)
        self.draft_pass = CapturedSteps(functools.partial(_head_pass_outputs, *reads, False, self.warpers,
                                                          self.do_sample), self.captured)
        self.catch_up_pass = CapturedSteps(functools.partial(_head_pass_outputs, *reads, True, self.warpers,
                                                             self.do_sample), self.captured)

    def start(self, prompts: list[torch.Tensor], first: torch.Tensor, features: torch.Tensor) -> None:
        """The prompts' entries (eager, packed): row r's prompt shifted by one with its first new token `first[r]`
        after it, over the prefill's `features` `[1, total, F]`."""
        shifted = [torch.cat([prompt[1:], token[None]]) for prompt, token in zip(prompts, first)]
        inputs = self.pool.prefill(shifted, self.attend)
        out = head_entries(self.model, self.head, features, inputs.tokens, inputs.positions, inputs.attention, True)
        self.last = readout(self.model, self.head, out[0, inputs.keep], self.warpers, self.do_sample)

    def draft(self, positions: torch.Tensor, k: int, generating: torch.Tensor) -> tuple[torch.Tensor,
                                                                                         torch.Tensor | None]:
        """Up to `k` drafts per row whose last token sits at `positions` `[rows]` -> `[rows, k']`, and when sampling
        the distributions they were drawn from `[rows, k', vocab]`: a chain ends after a draft no `generating` row's
        head gave at least `min_probability`."""
        drafts = [self.last]
        zeros = torch.zeros_like(positions)
        for j in range(k - 1):
            # the cut reads the device (a synchronisation per draft): only when it can end a chain
            if self.min_probability > 0 and not bool(((drafts[-1].confidence >= self.min_probability)
                                                      & generating).any()):
                break
            drafts.append(HeadOutput(*self.draft_pass(drafts[-1].hidden[:, None], drafts[-1].token[:, None],
                                                      positions + j, zeros)))
        tokens = torch.stack([d.token for d in drafts], dim=1)
        return tokens, torch.stack([d.probs for d in drafts], dim=1) if self.do_sample else None

    def catch_up(self, features: torch.Tensor, next_tokens: torch.Tensor, start: torch.Tensor,
                 accepted: torch.Tensor) -> None:
        """After a verify forward from `start` `[rows]`: its `features` `[rows, 1 + k, F]` and the emitted token
        after each position `[rows, 1 + k]` (the true next token up to `start + accepted + 1`) become entries
        `start .. start + k`; keeps the draft from the output at `start + accepted`."""
        self.last = HeadOutput(*self.catch_up_pass(features, next_tokens, start, accepted))


def compiled_eagle_generate(call: GenerateCall,
                            options: EagleOptions) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """EAGLE speculation with compiled forwards (see the module docstring), greedy or (with `do_sample`) sampled
    after the call's warpers; returns what `generate` returns."""
    model, head = call.model, options.eagle_head
    length = DraftLength(options.num_draft_tokens, options.max_draft_tokens, allow_off=False)
    head.check_compatible(model)
    target = TargetRounds(call, length.max_tokens, options.eagle_stats, head.config.feature_layers)
    pool = pool_for(head, target.prompts, target.outputs.max_new_tokens, length.max_tokens, call.generation_config,
                    head.midlayer.self_attn.config)
    compile_config = call.generation_config.compile_config
    rounds = HeadRounds(model, head, pool, target.attends.verify, compiled_head_pass(compile_config, head, model),
                        options.min_draft_probability, target.warpers, target.do_sample,
                        captured=captures(pool.device, compile_config.mode))
    return target.run(lambda: _round(target, rounds, length),
                      lambda: rounds.start(target.prompts, target.last, target.features),
                      (head.attention_implementation(ATTENTION_NAME),))


def _round(target: TargetRounds, head: HeadRounds, length: DraftLength) -> None:
    """Draft with the head, verify, let the head read the verified features, adapt k. Where no row may gain two
    tokens (the last round) the round still verifies the head's first candidate, counted as none (none can be kept),
    so that no decode-step graph is compiled for that one token."""
    started, generating = time.perf_counter(), [not done for done in target.outputs.finished]
    remaining = [left for left, on in zip(target.outputs.remaining, generating) if on]
    k = length.next(max(remaining), len(generating))
    start = target.positions
    candidates, probs = head.draft(start, max(k, 1), torch.tensor(generating, device=start.device))
    counts = None if k else torch.zeros_like(start)
    accepted = target.verify_round(candidates, counts, probs)
    head.catch_up(target.features, target.verdict.tokens, start, target.verdict.num_accepted)
    if k:
        target.stats.num_draft_forwards += candidates.shape[1]
        length.update(candidates.shape[1], [n for n, on in zip(accepted, generating) if on], len(generating),
                      time.perf_counter() - started, remaining)
