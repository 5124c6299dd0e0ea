"""Which sequences run in the next step, and how many tokens each computes. Plain Python, no torch.

Rules:
- order is priority (lower first), then arrival; `waiting` and `running` are kept in that order;
- one step computes at most `max_num_batched_tokens` tokens: running decodes first (one token each), then running
  prefills in chunks, then new sequences, so a long prompt never stalls running decodes (chunked prefill);
- at most `max_num_seqs` sequences run at once; a new one is admitted only when its blocks (minus prefix-cache
  hits) are free, and only in order: the head of the queue is never overtaken;
- when a running sequence cannot get a block, the last running sequence in order is preempted by recompute: its
  blocks are freed and it waits again with its tokens so far, to be prefilled anew (outputs are unchanged);
- speculation: a decode gets room for the candidates `room(seq, width, num_decodes)` wants (`width` from
  `draft_width`: decodes x (1 + width) within `max_speculative_batch_tokens`; the proposer's sequences take `width`,
  a constrained sequence its grammar's forced tokens), capped by its tokens left and the step's budget; the
  candidates count in the budget and get blocks, but never preempt: without free blocks it decodes plainly. The
  proposer may then propose fewer (`ScheduledSeq.keep_drafts`): the step computes only those, and the blocks
  reserved past them stay with the sequence for its next tokens;
- residency (LoRA adapters): a sequence is admitted only once `residency.acquire(seq)` holds what it needs beside
  its blocks (its adapter's slot), in order like blocks; it lets go when preempted, finished or aborted.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_speculative_tokens: int = 0
    max_speculative_batch_tokens: int = 24


def draft_width(num_decodes: int, num_speculative_tokens: int, max_speculative_batch_tokens: int) -> int:
    """Candidates per decoding sequence this step: the most, up to `num_speculative_tokens`, that keep
    `num_decodes * (1 + k)` within `max_speculative_batch_tokens` (0: decode plainly)."""
    if num_decodes == 0:
        return 0
    return max(min(num_speculative_tokens, max_speculative_batch_tokens // num_decodes - 1), 0)


@dataclass(slots=True)
class ScheduledSeq:
    """`num_new` tokens of `seq` this step, starting at its `num_computed_tokens`; the last `num_drafts` of them are
    candidates proposed after its last token (0 unless it speculates), `draft_token_ids` once proposed (never part of
    the sequence's tokens until accepted)."""

    seq: Sequence
    num_new: int
    num_drafts: int = 0
    draft_token_ids: list[int] = field(default_factory=list)

    def keep_drafts(self, tokens: list[int]) -> None:
        """Take the proposed candidates (at most `num_drafts` of them); the step computes only those."""
        tokens = tokens[: self.num_drafts]
        self.num_new -= self.num_drafts - len(tokens)
        self.num_drafts, self.draft_token_ids = len(tokens), tokens

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last token (so it samples, or verifies its candidates)."""
        return self.seq.num_computed_tokens + self.num_new - self.num_drafts == self.seq.num_tokens


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work, in packing order, and the sequences preempted while planning it."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled]

    def add(self, seq: Sequence, num: int, num_drafts: int = 0) -> None:
        self.scheduled.append(ScheduledSeq(seq, num, num_drafts))

    def drop(self, seq: Sequence) -> None:
        self.scheduled = [s for s in self.scheduled if s.seq is not seq]


class Residency(Protocol):
    """What a running sequence holds beside its blocks (an engine's LoRA slots)."""

    def acquire(self, seq: Sequence) -> bool:
        """Take it for `seq` (idempotent); False, changing nothing, when it is not to be had now."""

    def release(self, seq: Sequence) -> None:
        """Let go of what `seq` holds, if anything."""


class Scheduler:
    """Waiting and running queues over a `BlockManager`; `room(seq, width, num_decodes)` says how many candidates a
    decode wants this step, given the step's `draft_width` and number of decodes (none by default); `residency`,
    what a sequence needs beside blocks to run (None: nothing)."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 room: Callable[[Sequence, int, int], int] = lambda seq, width, num_decodes: 0,
                 residency: Residency | None = None):
        self.config = config
        self.blocks = blocks
        self.room = room
        self.residency = residency
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def postprocess(self, batch: ScheduledBatch, num_accepted: dict[int, int]) -> None:
        """After a step: each scheduled sequence has computed its new tokens (a speculating one its last token and
        the `num_accepted[seq_id]` candidates it kept: K/V past them is garbage, later steps overwrite it), its full
        blocks join the prefix cache, and finished ones leave with their blocks. Sequences of requests that failed
        in the step were removed already."""
        for s in batch.scheduled:
            seq = s.seq
            if seq.request.error is not None:
                continue
            seq.num_computed_tokens += s.num_new - s.num_drafts + num_accepted.get(seq.seq_id, 0)
            self.blocks.cache_full_blocks(seq)
            if seq.is_finished:
                self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and free its blocks (finish or abort)."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.blocks.free(seq)
        if self.residency is not None:
            self.residency.release(seq)

    def schedule(self) -> ScheduledBatch:
        """Plan the next step (empty when nothing can run)."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        width = draft_width(len(decodes), self.config.num_speculative_tokens, self.config.max_speculative_batch_tokens)
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            wanted = self.room(seq, width, len(decodes)) if seq.can_speculate else 0
            drafts = min(wanted, seq.num_tokens_left - 1, budget - 1)
            if drafts > 0 and self.blocks.allocate(seq, 1 + drafts):  # candidates never preempt anyone
                batch.add(seq, 1 + drafts, drafts)
                budget -= 1 + drafts
                continue
            num = min(seq.num_uncomputed_tokens, budget)
            if self._reserve(seq, num, batch):
                batch.add(seq, num)
                budget -= num
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _reserve(self, seq: Sequence, num: int, batch: ScheduledBatch) -> bool:
        """Blocks for `num` tokens of a running sequence, preempting from the back of `running` until they fit."""
        while not self.blocks.allocate(seq, num):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        batch.drop(seq)  # if scheduled earlier in this step: undo that
        self.blocks.free(seq)
        if self.residency is not None:
            self.residency.release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self.add(seq)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.residency is not None and not self.residency.acquire(seq):
                break
            # keep a block per running sequence free, so admitting does not force the next decodes to preempt
            if not self.blocks.allocate_with_prefix(seq, budget, reserve=len(self.running)):
                if self.residency is not None:
                    self.residency.release(seq)
                break
            num = min(seq.num_uncomputed_tokens, budget)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            batch.add(seq, num)
            budget -= num
