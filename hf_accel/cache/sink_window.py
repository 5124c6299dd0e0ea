"""SinkWindow: which token column each buffer slot of a `SinkCache` holds, shared by all its layers; it plans every
forward step once (`SinkStep`) and each layer executes the plan on its own tensors.

Rules (N = window_length, S = num_sink_tokens, `seen` = columns before the step, q = new tokens, p = a row's pads):
- returned columns: `kv_offset = max(seen - N, 0)` .. `seen + q - 1`; slot of column c is `c - slot_column`;
- sink region: the first S returned slots; a row with `kv_offset > p` shows there its sinks (columns p .. p + S - 1,
  captured as they arrived, at their own positions) rotated by `delta = kv_offset - p`; any other row shows the true
  columns, pads included (the mask hides them);
- columns below `first_column` are gone: `crop` may not move `seen` back so far that the next step needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rope import rotation
from .sink_config import SinkCacheConfig


@dataclass(slots=True)
class SinkStep:
    """One forward step, the same for every sink layer; slots index buffers `[rows, kv_heads, capacity, head_dim]`."""

    num_new: int  # q: tokens this step
    capacity: int  # slots the buffers must have
    read_slot: int  # slot of column kv_offset, the first one returned
    write_slot: int  # slot of the first new token; cached columns are read_slot .. write_slot - 1
    compact: tuple[int, int] | None = None  # (source slot, length): move cached columns to slot 0 first
    show_sinks: bool = False  # some rows show their stored sinks in slots read_slot .. read_slot + S - 1
    sink_rows: torch.Tensor | None = None  # [rows] bool: those rows (None: every row)
    cos: torch.Tensor | None = None  # [rows, rotary_dim] fp32: moves stored sinks by each row's delta
    sin: torch.Tensor | None = None
    capture_index: torch.Tensor | None = None  # [rows, S]: this step's token that is sink i of the row (clamped)
    capture_valid: torch.Tensor | None = None  # [rows, S] bool: sink i arrives in this step
    overflow: bool = False  # returned K/V exceed the buffer: concatenate, keep the last `keep` tokens in slots 0..
    keep: int = 0


class SinkWindow:
    """Column bookkeeping of one `SinkCache` (see the module rules); plain ints plus the per-row pad counts."""

    def __init__(self, settings: SinkCacheConfig, inv_freq: torch.Tensor, pad_counts: torch.Tensor | None,
                 capacity_hint: int | None = None):
        self.settings = settings
        self.inv_freq = inv_freq  # [rotary_dim / 2] fp32
        n = settings.window_length
        self.max_capacity = n + max(n // 8, 64)  # slack: room for lazy eviction, compaction every `slack` steps
        self.capacity_hint = capacity_hint
        self.set_pad_counts(pad_counts)
        self.num_seen = 0

    def set_pad_counts(self, pad_counts: torch.Tensor | None) -> None:
        """`[rows]` pad columns before each row's first real token (None: no padding, any number of rows)."""
        self.pad_counts = pad_counts
        # bounds, not exact values after a row selection: used only to skip work that would change nothing
        self.min_pad = 0 if pad_counts is None else int(pad_counts.min())
        self.max_pad = 0 if pad_counts is None else int(pad_counts.max())
        self.num_seen = self.capacity = self.slot_column = self.first_column = 0

    @property
    def num_rows(self) -> int:
        return 0 if self.pad_counts is None else self.pad_counts.shape[0]

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)`: the step returns columns kv_offset .. kv_offset + kv_length - 1."""
        kv_offset = max(self.num_seen - self.settings.window_length, 0)
        return self.num_seen - kv_offset + query_length, kv_offset

    def plan(self, num_new: int, num_rows: int, device: torch.device) -> SinkStep:
        """Lay out a step of `num_new` tokens per row and advance `num_seen`."""
        pads = self._pads(num_rows, device)
        seen = self.num_seen
        kv_offset = max(seen - self.settings.window_length, 0)
        step = self._layout(num_new, seen, kv_offset)
        self._add_sinks(step, kv_offset, pads)
        self._add_capture(step, seen, pads)
        self.num_seen = seen + num_new
        return step

    def kept(self, num_rows: int, device: torch.device) -> SinkStep:
        """The columns a next step would read before its new tokens (`read_slot .. write_slot - 1`), with the sinks it
        would show; changes nothing (`SinkLayer.keys` reads through it)."""
        seen = self.num_seen
        kv_offset = max(seen - self.settings.window_length, 0)
        step = SinkStep(0, self.capacity, kv_offset - self.slot_column, seen - self.slot_column)
        pads = self.pad_counts if self.pad_counts is not None else torch.zeros(num_rows, dtype=torch.long)
        self._add_sinks(step, kv_offset, pads.to(device))
        return step

    def _layout(self, num_new: int, seen: int, kv_offset: int) -> SinkStep:
        total, length = seen + num_new, seen + num_new - kv_offset
        read, write = kv_offset - self.slot_column, seen - self.slot_column
        if length > self.max_capacity:
            keep = min(self.max_capacity, total)
            self.capacity, self.slot_column = self.max_capacity, total - keep
            self.first_column = self.slot_column
            return SinkStep(num_new, self.capacity, read, write, overflow=True, keep=keep)
        if length > self.capacity:
            first = self.capacity_hint or self.max_capacity
            self.capacity = min(self.max_capacity, max(length, 2 * self.capacity if self.capacity else first))
        compact = None
        if total - self.slot_column > self.capacity:
            compact, self.slot_column = (read, seen - kv_offset), kv_offset
            read, write = 0, seen - kv_offset
        self.first_column = kv_offset
        return SinkStep(num_new, self.capacity, read, write, compact=compact)

    def _add_sinks(self, step: SinkStep, kv_offset: int, pads: torch.Tensor) -> None:
        if self.settings.num_sink_tokens == 0 or kv_offset <= self.min_pad:
            return
        step.show_sinks = True
        step.sink_rows = None if kv_offset > self.max_pad else kv_offset > pads
        step.cos, step.sin = rotation((kv_offset - pads).clamp(min=0), self.inv_freq)

    def _add_capture(self, step: SinkStep, seen: int, pads: torch.Tensor) -> None:
        num_sinks = self.settings.num_sink_tokens
        if num_sinks == 0 or seen >= self.max_pad + num_sinks:
            return
        index = pads[:, None] + torch.arange(num_sinks, device=pads.device) - seen  # [rows, S]
        step.capture_valid = (index >= 0) & (index < step.num_new)
        step.capture_index = index.clamp(0, step.num_new - 1)

    def _pads(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self.pad_counts is None:
            self.pad_counts = torch.zeros(num_rows, dtype=torch.long, device=device)
        elif self.num_rows != num_rows:
            if self.num_seen or num_rows % self.num_rows:
                raise ValueError(f"SinkCache holds {self.num_rows} rows (its `attention_mask`) but got {num_rows}")
            self.pad_counts = self.pad_counts.repeat_interleave(num_rows // self.num_rows)  # generate's expansion
        if self.pad_counts.device != device:
            self.pad_counts = self.pad_counts.to(device)
        return self.pad_counts

    def crop(self, num_tokens: int) -> None:
        """Move `num_seen` back by `num_tokens` (>= 0); raises `ValueError` if the next step would need evicted ones."""
        total = self.num_seen - num_tokens
        if total < 0 or max(total - self.settings.window_length, 0) < self.first_column:
            removable = self.num_seen if self.first_column == 0 else (
                self.num_seen - self.settings.window_length - self.first_column)
            raise ValueError(
                f"Cannot crop {num_tokens} tokens from the sink cache: it can give back at most {removable} "
                "(the tokens of its last step beyond the window); older ones are evicted")
        self.num_seen = total

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (`[new_rows]`, e.g. beam search's `beam_idx`)."""
        if self.pad_counts is not None:
            self.pad_counts = self.pad_counts.index_select(0, index.to(self.pad_counts.device))

    def repeat_rows(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (`batch_repeat_interleave`)."""
        if self.pad_counts is not None:
            self.pad_counts = self.pad_counts.repeat_interleave(repeats)

    def reset(self) -> None:
        """Forget every token and the padding; the next step starts a new request."""
        self.set_pad_counts(None)
