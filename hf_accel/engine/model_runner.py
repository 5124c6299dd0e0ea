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

from .attention import ATTENTION_NAME, StepAttention, gathered_attention, register_attention
from .kv_pool import KVPool
from .paged_kernel import paged_attention_kernel
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
        self.device = next(model.parameters()).device
        # built (or found in torch's cache) now, once per engine; the kernel is CPU code
        kernel = paged_attention_kernel() if self.device.type == "cpu" else None
        self.attend = kernel if kernel is not None else gathered_attention
        self.model, self.kv, self.keep_hidden = model, kv, keep_hidden

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step; keeps the rows of the sequences whose last token this step computes (and their
        candidates, `draft_token_ids`, `num_drafts` of them)."""
        tokens, positions, slots, keep, sampling, starts = [], [], [], [], [], []
        query_start, kv_lengths, tables = [0], [], []
        size = self.kv.block_size
        for scheduled in batch.scheduled:
            seq, num, drafts = scheduled.seq, scheduled.num_new, scheduled.num_drafts
            start, first = len(tokens), seq.num_computed_tokens
            tokens += seq.token_ids[first : first + num - drafts] + scheduled.draft_token_ids
            positions += range(first, first + num)
            slots += self._slots(seq, first, first + num)
            query_start.append(len(tokens))
            kv_lengths.append(first + num)
            tables.append(seq.block_ids[: -(-(first + num) // size)])
            if scheduled.samples:
                starts.append(len(keep))
                keep += range(start + num - 1 - drafts, start + num)
                sampling.append(scheduled)
        width = max(map(len, tables))
        step = StepAttention(
            self.kv, self._tensor(slots), self._tensor([table + [0] * (width - len(table)) for table in tables]),
            self._tensor(query_start), self._tensor(kv_lengths), self.attend)
        keep_index = self._tensor(keep)
        with torch.inference_mode(), paged_attention_implementation(self.model):
            out = self.model(
                input_ids=self._tensor([tokens]), position_ids=self._tensor([positions]),
                use_cache=False, logits_to_keep=keep_index, hf_accel_step=step,
                output_hidden_states=self.keep_hidden,
            )
        hidden = out.hidden_states[-1][0, keep_index] if self.keep_hidden else None
        return StepOutput(out.logits[0].float(), hidden, sampling, starts)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _slots(self, seq: Sequence, start: int, stop: int) -> list[int]:
        size, blocks = self.kv.block_size, seq.block_ids
        return [blocks[p // size] * size + p % size for p in range(start, stop)]
