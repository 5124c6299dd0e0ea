"""The EAGLE head's side of a speculative batch: its own KV cache laid out like the target's, and its draft steps.

Layout: the head's cache has one slot per cache column of the `RaggedBatch` (see ragged_batch.py), so it is cropped
like the target's and masked by the same `mask`. Slot c holds the entry (target feature at column c, token of the
next real column after c): the entry whose output predicts the token after that one. Like the target's cache it
holds every column but the last (the newest token's feature is unknown until the target reads it). After a
verification the target's fused features of the new columns wait in `pending`; the next round's `catch_up` runs
them through the head in one pass, and the output at each row's last real slot is its first draft's hidden state.
Each further draft step appends one entry (the head's own previous output, the token just drafted) after the
newest column; `drop_drafts` crops them off once the round is verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from .eagle_head import EagleHead, token_embeddings
from .ragged_batch import RaggedBatch


@dataclass(slots=True)
class HeadState:
    """The head, its cache, how many columns the cache holds, and the fused target features waiting for it."""

    head: EagleHead
    cache: DynamicCache
    pending: torch.Tensor  # [batch, width - 1 - num_seen, H] fused features of columns num_seen .. width - 2
    num_seen: int = 0  # cache slots holding target-feature entries (columns 0 .. num_seen - 1)

    def catch_up(self, model: PreTrainedModel, batch: RaggedBatch) -> torch.Tensor:
        """Run the pending entries through the head; returns each row's output at its last real slot, `[batch, H]`:
        the hidden state of the first draft."""
        start, end = self.num_seen, batch.width - 1
        tokens = next_real_tokens(batch.columns, batch.mask, batch.pad_token_id)[:, start:end]
        valid = batch.mask[:, :end].bool()
        mask = slot_mask(valid, end - start, self.head.dtype)
        out = self.head(self.pending, token_embeddings(model, tokens), batch.positions[:, start:end], mask, self.cache)
        self.num_seen, self.pending = end, self.pending[:, :0]
        slots = torch.arange(end - start, device=valid.device)
        last = torch.where(valid[:, start:end], slots, -1).max(dim=1).values.clamp_min(0)  # [batch]
        return out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]

    def draft_step(self, model: PreTrainedModel, batch: RaggedBatch, hidden: torch.Tensor, token: torch.Tensor,
                   index: int) -> torch.Tensor:
        """Draft step `index + 2` (0-based `index`): the entry (`hidden` `[batch, H]`, the drafted `token`
        `[batch]`) sits `index` slots after the newest column; returns its output `[batch, H]`."""
        positions = batch.positions[:, -1:] + index
        mask = None
        if not batch.is_dense:  # every draft entry is real; the cached slots are real where the batch's are
            drafts = batch.mask.new_ones(batch.mask.shape[0], index + 1)
            valid = torch.cat([batch.mask[:, :-1].bool(), drafts.bool()], 1)
            mask = slot_mask(valid, 1, self.head.dtype)
        out = self.head(hidden[:, None], token_embeddings(model, token[:, None]), positions, mask, self.cache)
        return out[:, 0]

    def tree_step(self, model: PreTrainedModel, batch: RaggedBatch, features: torch.Tensor, tokens: torch.Tensor,
                  index: int, visible: torch.Tensor) -> torch.Tensor:
        """One level of a draft tree (`eagle_tree.grow_tree`): entries (`features` `[batch, k, H]`, their nodes'
        `tokens` `[batch, k]`) for nodes at depth `index + 1`, appended after the draft entries already cached;
        `visible` `[batch, k, drafts + k]` bool says which draft entries (earlier levels', then these) each one
        sees: its ancestors' and its own. Every entry sees the row's real target slots. Returns `[batch, k, H]`."""
        rows, k = tokens.shape
        positions = (batch.positions[:, -1:] + index).expand(rows, k)
        targets = batch.mask[:, :-1].bool()[:, None].expand(rows, k, -1)  # the cached target entries' slots
        allowed = torch.cat([targets, visible], dim=2)
        mask = torch.zeros(allowed.shape, dtype=self.head.dtype, device=allowed.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(self.head.dtype).min)[:, None]
        return self.head(features, token_embeddings(model, tokens), positions, mask, self.cache)

    def drop_drafts(self) -> None:
        """Crop the draft entries off the cache (target-feature entries replace them next round)."""
        extra = self.cache.get_seq_length() - self.num_seen
        if extra > 0:
            self.cache.crop(-extra)

    def add_pending(self, features: torch.Tensor) -> None:
        """Queue fused target features `[batch, n, H]` of the next `n` columns."""
        self.pending = torch.cat([self.pending, features.to(self.pending.dtype)], dim=1)


def new_head_state(head: EagleHead, batch_size: int, device: torch.device) -> HeadState:
    """An empty state: no cache slots, nothing pending."""
    pending = torch.zeros(batch_size, 0, head.config.hidden_size, dtype=head.dtype, device=device)
    return HeadState(head, DynamicCache(), pending)


def next_real_tokens(columns: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """`[batch, width]`: for each column, the token of the next column after it whose `mask` is 1 (`pad_token_id`
    when there is none)."""
    width = columns.shape[1]
    index = torch.arange(width, device=columns.device).expand_as(columns)
    real = torch.where(mask.bool(), index, width)
    first_from = real.flip(1).cummin(dim=1).values.flip(1)  # first real column >= c
    after = torch.cat([first_from[:, 1:], torch.full_like(first_from[:, :1], width)], dim=1)  # first real > c
    return torch.where(after < width, columns.gather(1, after.clamp_max(width - 1)), pad_token_id)


def slot_mask(valid: torch.Tensor, num_queries: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[batch, 1, num_queries, slots]` for queries in the last `num_queries` of `valid` `[batch,
    slots]` (bool, real entries): a query sees real slots up to its own, and always itself (0 attend, dtype min
    masked)."""
    slots = valid.shape[1]
    query_slots = torch.arange(slots - num_queries, slots, device=valid.device)[:, None]  # [q, 1]
    key_slots = torch.arange(slots, device=valid.device)[None, :]  # [1, slots]
    allowed = (valid[:, None, :] & (key_slots <= query_slots)) | (key_slots == query_slots)  # [batch, q, slots]
    additive = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
