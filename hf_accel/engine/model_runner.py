"""One model forward per engine step: the scheduled tokens of every sequence packed into one row.

The model runs its own, unmodified forward with `attn_implementation` switched to hf_accel's paged attention for
the call (restored after), `use_cache=False` (K/V live in the engine's pool, written by the attention function),
per-token `position_ids`, and `logits_to_keep` set to the last token of each sequence that samples this step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from .attention import ATTENTION_NAME, PrefillRow, StepAttention, register_attention
from .kv_pool import KVPool
from .scheduler import ScheduledBatch
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


class ModelRunner:
    """Runs scheduled batches of `model` over the block pool `kv`."""

    def __init__(self, model: PreTrainedModel, kv: KVPool):
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(f"`model` ({type(model).__name__}) does not use transformers' AttentionInterface, "
                             "which the engine needs")
        register_attention()
        self.model, self.kv = model, kv
        self.device = next(model.parameters()).device

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns `[num_sampling, vocab]` fp32 logits and the sequences they belong to (those whose
        last token this step computes)."""
        tokens, positions, slots, keep, sampling = [], [], [], [], []
        decodes, prefills = [], []
        for seq, num in zip(batch.seqs, batch.num_new_tokens):
            start, first = len(tokens), seq.num_computed_tokens
            tokens += seq.token_ids[first : first + num]
            positions += range(first, first + num)
            slots += self._slots(seq, first, first + num)
            (decodes if num == 1 else prefills).append((seq, start, num))
            if first + num == seq.num_tokens:
                keep.append(start + num - 1)
                sampling.append(seq)
        step = self._step_attention(torch.tensor(slots, device=self.device), decodes, prefills)
        with torch.inference_mode(), paged_attention_implementation(self.model):
            out = self.model(
                input_ids=torch.tensor([tokens], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False,
                logits_to_keep=torch.tensor(keep, device=self.device),
                hf_accel_step=step,
            )
        return out.logits[0].float(), sampling

    def _slots(self, seq: Sequence, start: int, stop: int) -> list[int]:
        size, blocks = self.kv.block_size, seq.block_ids
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def _step_attention(self, write_slots: torch.Tensor, decodes: list, prefills: list) -> StepAttention:
        size = self.kv.block_size
        rows = [PrefillRow(start, num, seq.num_computed_tokens,
                           torch.tensor(seq.block_ids[: -(-(seq.num_computed_tokens + num) // size)], device=self.device))
                for seq, start, num in prefills]
        if not decodes:
            return StepAttention(self.kv, write_slots, None, None, None, rows)
        lengths = [seq.num_computed_tokens + 1 for seq, _, _ in decodes]
        return StepAttention(
            self.kv, write_slots,
            decode_index=torch.tensor([start for _, start, _ in decodes], device=self.device),
            decode_blocks=self._block_table([seq for seq, _, _ in decodes]),
            decode_lengths=torch.tensor(lengths, device=self.device),
            prefills=rows,
        )

    def _block_table(self, seqs: list[Sequence]) -> torch.Tensor:
        # [num_seqs, max_blocks] block ids of the tokens each attends over, padded with block 0 (masked by lengths)
        size = self.kv.block_size
        width = max(-(-(seq.num_computed_tokens + 1) // size) for seq in seqs)
        return torch.tensor([(seq.block_ids + [0] * width)[:width] for seq in seqs], device=self.device)
