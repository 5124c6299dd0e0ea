"""One model forward per engine step: the scheduled tokens of every sequence packed into one row.

The model runs its own, unmodified forward with `attn_implementation` switched to hf_accel's paged attention for
the call (restored after), `use_cache=False` (K/V live in the engine's pool, written by the attention function),
per-token `position_ids`, and `logits_to_keep` set to the last token of each sequence that samples this step, plus
its candidates when it speculates. With Medusa heads the same forward also returns the final (normed) hidden
states at those positions (`output_hidden_states`: transformers ties the last entry to the normed output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .attention import ATTENTION_NAME, DecodeGroup, PrefillRow, StepAttention, register_attention
from .kv_pool import KVPool
from .paged_kernel import paged_decode_kernel
from .scheduler import ScheduledBatch, ScheduledSeq
from .sequence import Sequence


@contextlib.contextmanager
def paged_attention_implementation(model: PreTrainedModel) -> Iterator[None]:
    """Run `model` with hf_accel's paged attention inside the block, its own implementation after (a no-op when
    already inside one: `Engine` switches once per run of steps, so single steps pay nothing)."""
    saved = model.config._attn_implementation
    if saved == ATTENTION_NAME:
        yield
        return
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(saved)


@dataclass(slots=True)
class StepOutput:
    """The kept positions of one step: `logits` `[rows, vocab]` fp32 and, when asked, `hidden` `[rows, hidden]`.
    `sampling[i]` (a scheduled sequence whose last token the step computed) owns the rows `rows(i)`: its last
    token's, then one per candidate."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    sampling: list[ScheduledSeq]
    starts: list[int]  # first row of each sampling sequence

    def rows(self, i: int) -> slice:
        return slice(self.starts[i], self.starts[i] + 1 + self.sampling[i].num_drafts)


class ModelRunner:
    """Runs scheduled batches of `model` over the block pool `kv` (`keep_hidden`: also return hidden states)."""

    def __init__(self, model: PreTrainedModel, kv: KVPool, keep_hidden: bool = False):
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(f"`model` ({type(model).__name__}) does not use transformers' AttentionInterface, "
                             "which the engine needs")
        register_attention()
        self.decode_kernel = paged_decode_kernel()  # built (or found in torch's cache) now, once per engine
        self.model, self.kv, self.keep_hidden = model, kv, keep_hidden
        self.device = next(model.parameters()).device

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step; keeps the rows of the sequences whose last token this step computes (and their
        candidates, `draft_token_ids`, `num_drafts` of them)."""
        tokens, positions, slots, keep, sampling, starts = [], [], [], [], [], []
        decodes: dict[int, list] = {}  # queries per sequence -> (seq, packed start) of the sequences computing them
        prefills = []
        for scheduled in batch.scheduled:
            seq, num, drafts = scheduled.seq, scheduled.num_new, scheduled.num_drafts
            start, first = len(tokens), seq.num_computed_tokens
            tokens += seq.token_ids[first : first + num - drafts] + scheduled.draft_token_ids
            positions += range(first, first + num)
            slots += self._slots(seq, first, first + num)
            if num == 1 or drafts:
                decodes.setdefault(num, []).append((seq, start))
            else:
                prefills.append((seq, start, num))
            if scheduled.samples:
                starts.append(len(keep))
                keep += range(start + num - 1 - drafts, start + num)
                sampling.append(scheduled)
        step = self._step_attention(torch.tensor(slots, device=self.device), decodes, prefills)
        keep_index = torch.tensor(keep, device=self.device)
        with torch.inference_mode(), paged_attention_implementation(self.model):
            out = self.model(
                input_ids=torch.tensor([tokens], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False, logits_to_keep=keep_index, hf_accel_step=step,
                output_hidden_states=self.keep_hidden,
            )
        hidden = out.hidden_states[-1][0, keep_index] if self.keep_hidden else None
        return StepOutput(out.logits[0].float(), hidden, sampling, starts)

    def _slots(self, seq: Sequence, start: int, stop: int) -> list[int]:
        size, blocks = self.kv.block_size, seq.block_ids
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def _step_attention(self, write_slots: torch.Tensor, decodes: dict[int, list], prefills: list) -> StepAttention:
        size = self.kv.block_size
        rows = [PrefillRow(start, num, seq.num_computed_tokens, torch.tensor(
                    seq.block_ids[: -(-(seq.num_computed_tokens + num) // size)], device=self.device))
                for seq, start, num in prefills]
        groups = [self._decode_group(num, members) for num, members in decodes.items()]
        return StepAttention(self.kv, write_slots, groups, rows, self.decode_kernel)

    def _decode_group(self, num: int, members: list) -> DecodeGroup:
        # block table [rows, max_blocks] of the tokens each attends over, padded with block 0 (masked by lengths)
        lengths = [seq.num_computed_tokens + num for seq, _ in members]
        width = -(-max(lengths) // self.kv.block_size)
        table = [(seq.block_ids + [0] * width)[:width] for seq, _ in members]
        return DecodeGroup(
            index=torch.tensor([range(start, start + num) for _, start in members], device=self.device),
            blocks=torch.tensor(table, device=self.device),
            lengths=torch.tensor(lengths, device=self.device),
        )
