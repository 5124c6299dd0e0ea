"""Rows of a speculative batch that accept different numbers of tokens, on caches that crop every row alike.

Two layouts of the same tokens:
- cache layout (`columns`, `mask`, `positions`, `[batch, width]`): what the target and draft caches hold, one column
  per cache slot. Every round appends the same number of columns to every row, M + 1 where M is the most drafts any
  row kept; a row that kept n < M drafts gets M - n holes (mask 0, never attended to) between its kept drafts and
  its newest token, so every row's newest token sits in the last column and both caches are cropped alike.
  `positions` count real tokens only, so RoPE sees each row as if it had no holes; the causal mask works on cache
  slots, which keep their order. The caches hold every column but the last (the newest token, not yet forwarded).
- compact layout (`tokens`, `[batch, prompt_width + max_new_tokens]`): the left-padded prompt, then each row's
  generated tokens with no holes; it is what `generate` returns and what logits processors and stopping criteria see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


@dataclass(slots=True)
class RaggedBatch:
    """Token state of one speculative `generate` call (see the module docstring for the two layouts)."""

    columns: torch.Tensor  # [batch, width] token per cache slot; holes and left padding hold `pad_token_id`
    mask: torch.Tensor  # [batch, width] 1 = real token, 0 = left padding or hole
    positions: torch.Tensor  # [batch, width] position id of each slot (real tokens before it)
    tokens: torch.Tensor  # [batch, prompt_width + max_new_tokens + 1] compact: prompt, generated tokens, pad; scratch
    num_generated: torch.Tensor  # [batch] tokens generated per row
    limit: torch.Tensor  # [batch] tokens a row generates before it pauses or ends (max_new_tokens until it stops)
    stopped: torch.Tensor  # [batch] bool: a stopping criterion fired for the row
    stop_lengths: torch.Tensor  # [batch] tokens generated up to and including the one a criterion fired on
    prompt_width: int
    max_new_tokens: int
    pad_token_id: int
    pad_finished: bool  # see `commit`
    is_dense: bool  # one row without padding: it never gets holes, so forwards need no attention mask

    @classmethod
    def from_prompt(
        cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, pad_token_id: int,
        pad_finished: bool = True,
    ) -> RaggedBatch:
        """A batch whose caches hold nothing yet; `input_ids`, `attention_mask`: `[batch, prompt_width]`."""
        batch, width = input_ids.shape
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        tokens = input_ids.new_full((batch, width + max_new_tokens + 1), pad_token_id)  # + a scratch column
        tokens[:, :width] = input_ids
        return cls(input_ids, attention_mask.long(), positions, tokens, input_ids.new_zeros(batch),
                   input_ids.new_full((batch,), max_new_tokens), torch.zeros(batch, dtype=torch.bool,
                   device=input_ids.device), input_ids.new_zeros(batch), width, max_new_tokens, pad_token_id,
                   pad_finished or batch == 1, batch == 1 and bool(attention_mask.all()))

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens `generate` returns per row (past a row's own count: padding)."""
        return int(torch.minimum(self.num_generated, self.limit).max())

    @property
    def num_rows(self) -> int:
        return self.columns.shape[0]

    @property
    def width(self) -> int:
        return self.columns.shape[1]

    @property
    def history_lengths(self) -> torch.Tensor:
        """`[batch]` compact length of each row (prompt width + generated)."""
        return self.prompt_width + self.num_generated

    @property
    def unfinished(self) -> torch.Tensor:
        """`[batch]` bool: rows still generating."""
        return self.num_generated < self.limit

    @property
    def remaining(self) -> torch.Tensor:
        """`[batch]` tokens each row may still generate (0 for finished rows)."""
        return (self.limit - self.num_generated).clamp_min(0)

    def with_candidates(self, candidates: torch.Tensor) -> torch.Tensor:
        """Compact tokens with `candidates` `[batch, k]` written after each row's history: `[batch, width + k]`."""
        k = candidates.shape[1]
        out = torch.cat([self.tokens, self.tokens.new_full((self.tokens.shape[0], k), self.pad_token_id)], dim=1)
        index = self.history_lengths[:, None] + torch.arange(k, device=out.device)
        return out.scatter(1, index, candidates)

    def view(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Row r's first `lengths[r]` compact `tokens`, right-aligned in `[batch, max(lengths)]` (padded on the
        left), as logits processors and stopping criteria expect a batch to look."""
        width = int(lengths.max())
        if tokens.shape[0] == 1:
            return tokens[:, :width]
        index = torch.arange(width, device=tokens.device) + (lengths - width)[:, None]
        gathered = tokens.gather(1, index.clamp_min(0))
        return torch.where(index >= 0, gathered, self.pad_token_id)

    def commit(
        self, emitted: torch.Tensor, num_emitted: torch.Tensor, fired: torch.Tensor | None, num_to_stop: torch.Tensor
    ) -> int:
        """Keep `num_emitted[r]` (>= 1) tokens of `emitted` `[batch, k + 1]` for every unfinished row; `fired[r]`: a
        stopping criterion fired on the row's token `num_to_stop[r]` (1-based) of them (None: no criterion was
        checked, as when the call has none). Appends M + 1 cache columns
        (M = most tokens kept minus one) and returns M; the caches must then hold every column but the last.

        With `pad_finished` (stock generate with an EOS criterion) a stopped row ends there and is padded; the
        caller keeps no token past the stop. Otherwise, as stock generate without EOS, stopped rows go on generating
        until every row has stopped, and all rows end at the longest stop (`num_output_tokens`)."""
        active = self.unfinished
        num_emitted = torch.where(active, num_emitted, 0)
        lengths = self.history_lengths
        steps = torch.arange(emitted.shape[1], device=emitted.device)
        scratch = self.tokens.shape[1] - 1  # tokens past a row's count all land in the scratch column
        index = torch.where(steps < num_emitted[:, None], lengths[:, None] + steps, scratch)
        self.tokens.scatter_(1, index, emitted)
        self.num_generated += num_emitted
        most = int(num_emitted.max()) - 1
        self._append_columns(emitted, num_emitted, active, most)
        if fired is None:  # no row stopped now, so no row's end moves
            return most
        newly = active & fired & ~self.stopped
        self.stopped |= newly
        self.stop_lengths = torch.where(newly, lengths - self.prompt_width + num_to_stop, self.stop_lengths)
        if self.pad_finished:
            self.limit = torch.where(newly, self.stop_lengths, self.limit)
        elif bool((self.stopped | ~self.unfinished).all()):  # every row stopped: all end at the longest stop
            self.limit = torch.where(self.stopped, self.stop_lengths, self.limit).max().expand_as(self.limit).clone()
        return most

    def _append_columns(self, emitted: torch.Tensor, num_emitted: torch.Tensor, active: torch.Tensor,
                        most: int) -> None:
        # new columns j = 0..most: kept drafts at j < n - 1, holes at n - 1 <= j < most, the newest token at `most`
        if most == 0:  # one token per row (a plain round): the common case, in a few ops
            self.columns = torch.cat([self.columns, emitted[:, :1].masked_fill(~active[:, None], self.pad_token_id)], 1)
            self.mask = torch.cat([self.mask, active[:, None].to(self.mask.dtype)], dim=1)
            self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], dim=1)
            return
        slots = torch.arange(most + 1, device=emitted.device)
        last = (num_emitted - 1).clamp_min(0)
        source = torch.where(slots[None, :] == most, last[:, None], slots[None, :].clamp_max(emitted.shape[1] - 1))
        real = ((slots[None, :] < last[:, None]) | (slots[None, :] == most)) & active[:, None]
        new_tokens = torch.where(real, emitted.gather(1, source), self.pad_token_id)
        step = torch.where(slots[None, :] == most, num_emitted[:, None], slots[None, :] + 1)
        new_positions = self.positions[:, -1:] + torch.where(real, step, 1)
        self.columns = torch.cat([self.columns, new_tokens], dim=1)
        self.mask = torch.cat([self.mask, real.to(self.mask.dtype)], dim=1)
        self.positions = torch.cat([self.positions, new_positions], dim=1)


def stack_steps(per_row: list[list[torch.Tensor]] | None, num_steps: int) -> tuple[torch.Tensor, ...] | None:
    """Per-row lists of `[vocab]` tensors (scores or logits, one per generated token) -> one `[batch, vocab]` tensor
    per step, as `generate` returns them (zeros after a row finished); None stays None."""
    if per_row is None:
        return None
    template = next(row[0] for row in per_row if row)
    return tuple(torch.stack([row[s] if s < len(row) else torch.zeros_like(template) for row in per_row])
                 for s in range(num_steps))


def batch_for_generate(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: GenerationConfig,
    criteria: StoppingCriteriaList,
) -> tuple[RaggedBatch, torch.Tensor | None, StoppingCriteriaList]:
    """What a speculative `custom_generate` starts from, as stock generate would decode `input_ids` `[batch,
    prompt_width]`: the `RaggedBatch` (`attention_mask` None: no padding; finished rows padded with
    `pad_token_id`, 0 when unset), the EOS ids of generate's `EosTokenCriteria` (None without one), and the other
    stopping criteria (max length and EOS are the batch's own `limit` and `pad_finished`)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    pad = config._pad_token_tensor
    pad = 0 if pad is None else int(pad.reshape(-1)[0])
    eos = [c.eos_token_id.reshape(-1) for c in criteria if isinstance(c, EosTokenCriteria)]
    eos = torch.cat(eos).to(input_ids.device) if eos else None  # stock generate pads finished rows only with EOS
    batch = RaggedBatch.from_prompt(input_ids, mask, config.max_length - input_ids.shape[1], pad, eos is not None)
    others = StoppingCriteriaList([c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))])
    return batch, eos, others
