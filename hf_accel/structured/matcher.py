"""`TokenMatcher`: one generated sequence's place in its grammar, and the masks that keep the sequence inside it.

A matcher follows the tokens a sequence commits (`accept`) and says which tokens may come next (`fill`: one row of
an xgrammar bitmask, `[rows, ceil(vocab / 32)]` int32, bit set = allowed). For speculative decoding, `fill_drafts`
fills the masks at the sequence's last token and at each of its `k` candidates, as if the candidates before each
position had been committed, and leaves the matcher where it was: the target's logits at every verified position
are masked by what the grammar allows there, so verification keeps exactly what constrained plain decoding would.
A candidate the grammar refuses ends the candidates that follow it: their masks allow everything, harmlessly, since
the mask before the refused candidate gives it no probability, so verification never gets past it.

A matcher whose grammar is complete and has accepted a stop token is terminated: its mask allows everything (the
sequence ends on that stop token; a mask allowing nothing would make sampling's probabilities NaN).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..kernels.custom_ops import masked_argmax_kernel, token_bitmask_kernel
from ..runtime.host_argmax import argmax_rows
from .forced_spelling import ForcedSpelling
from .grammars import xgrammar

MAX_DRAFTED = 8  # forced texts a matcher waits to see written at once (older ones are dropped unrecorded)


class TokenMatcher:
    """The grammar state of one sequence, over a compiled grammar (xgrammar `CompiledGrammar`)."""

    def __init__(self, compiled: Any, spelling: ForcedSpelling | None = None):
        self._matcher = xgrammar().GrammarMatcher(compiled)
        self._accepted: list[int] = []  # the tokens it has advanced over, in order
        self._forced: list[int] | None = None  # jump-forward tokens at its place, once asked
        self._spelling = spelling  # the model's spellings of forced text, shared with other matchers
        self._drafted: list[tuple[str, int, int]] = []  # forced text drafted, not yet written past: (text, at, bytes)

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and a stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advance over a committed token; ValueError if the grammar does not allow it (the mask did not hold)."""
        if not self.advance(token):
            raise ValueError(f"token {token} does not fit the request's `structured_outputs` constraint")

    def forced_tokens(self) -> list[int]:
        """Tokens that spell the text the grammar forces next (jump-forward: the only continuation it allows; stop
        tokens excluded): the model's own spelling of that text where this matcher's `ForcedSpelling` has seen it
        write it, else the vocabulary's longest tokens; empty when the next token is a choice. Kept until the matcher
        moves."""
        if self._forced is None:
            self._forced = [] if self._matcher.is_terminated() else self._forced_now()
        return self._forced

    def _forced_now(self) -> list[int]:
        if self._spelling is None:
            return list(self._matcher.find_jump_forward_tokens())
        self._drafted = [d for d in self._drafted  # what the model wrote since each forced text was drafted
                         if not self._spelling.record(d[0], d[2], self._accepted[d[1]:])]
        text = self._matcher.find_jump_forward_string()
        if not text:
            return list(self._matcher.find_jump_forward_tokens())
        if not self._drafted or self._drafted[-1][1] != len(self._accepted):
            self._drafted = [*self._drafted[-MAX_DRAFTED + 1:], (text, len(self._accepted), len(text.encode()))]
        spelled = self._spelling.get(text)
        return spelled if spelled is not None else list(self._matcher.find_jump_forward_tokens())

    @property
    def num_accepted(self) -> int:
        """How many tokens it has advanced over."""
        return len(self._accepted)

    def advance(self, token: int) -> bool:
        """`follow` of the tokens accepted so far and `token`: False, staying where it is, when the grammar refuses
        it (or it follows a stop token)."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(token):
            return False
        self._accepted.append(token)
        self._forced = None
        return True

    def follow(self, tokens: Sequence[int]) -> bool:
        """Move to the place after `tokens` (the sequence's output so far, which may have dropped rejected
        candidates or gained new ones since the last call): roll back to the longest prefix shared with the tokens
        accepted before, then accept the rest. False when the grammar refuses one of them (or one follows a stop
        token): the matcher then stays after the longest prefix that fits."""
        accepted = self._accepted
        if tokens[: len(accepted)] == accepted:  # the usual case, new tokens after the old ones (compared in C)
            common = len(accepted)
        else:
            common = 0
            while common < min(len(accepted), len(tokens)) and accepted[common] == tokens[common]:
                common += 1
        if common < len(accepted):  # (`advance` forgets the forced tokens where it moves on)
            self._forced = None
            self._matcher.rollback(len(accepted) - common)
            del accepted[common:]
            self._drafted = [d for d in self._drafted if d[1] <= common]
        return all(self.advance(token) for token in tokens[common:])

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Row `row` of `bitmask`: the tokens allowed next; False when that is every token (the row needs no
        applying)."""
        if self._matcher.is_terminated():
            bitmask[row].fill_(-1)
            return False
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, drafts: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Rows `row` .. `row + len(drafts)` of `bitmask`: the tokens allowed after the committed tokens and after
        each prefix of `drafts`; the matcher is left as it was."""
        accepted = 0
        self.fill(bitmask, row)
        for j, token in enumerate(drafts, start=1):
            if accepted == j - 1 and not self._matcher.is_terminated() and self._matcher.accept_token(token):
                accepted = j
                self.fill(bitmask, row + j)
            else:  # past a refused candidate: never reached by verification
                bitmask[row + j].fill_(-1)
        if accepted:
            self._matcher.rollback(accepted)


def token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for `rows` rows over `vocab_size` tokens (`[rows, ceil(vocab / 32)]` int32)."""
    return xgrammar().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set the logits `[rows, vocab]` of forbidden tokens to -inf in place (only `rows` of `logits`, when given).
    On the CPU hf_accel's kernel (csrc/token_bitmask.cpp: a word of 32 forbidden tokens is one vector store, where
    xgrammar's writes one token at a time: 5 ms a step at batch 8 over a 128k vocabulary); else xgrammar's."""
    kernel = token_bitmask_kernel() if logits.device.type == "cpu" and logits.stride(-1) == 1 else None
    if kernel is None:
        xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return
    kernel(logits, bitmask, _row_indices(tuple(range(logits.shape[0])) if rows is None else tuple(rows)))


# one index tensor per row set, made once: a new tensor a step costs ~10 us between decode steps (a cold cache)
@functools.lru_cache(maxsize=256)
def _row_indices(rows: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def fill_rows(matchers: Sequence[TokenMatcher | None], vocab_size: int) -> tuple[torch.Tensor | None, list[int]]:
    """What each row's matcher (None: unconstrained) allows next, in one bitmask `[rows, ceil(vocab / 32)]` int32 for
    the whole batch (this thread's, reused from step to step), and the rows it restricts (only those rows of the
    bitmask are written). The live rows are filled by xgrammar's batch matcher in one call; a lone live row by its
    matcher, which says when it allows every token. A row allowing every token, or a terminated matcher's, is left
    out. (None, []) when no row is restricted."""
    live = [i for i, matcher in enumerate(matchers) if matcher is not None and not matcher.is_terminated]
    if not live:
        return None, []
    bitmask = step_bitmask(len(matchers), vocab_size)
    if len(live) == 1:
        return (bitmask, live) if matchers[live[0]].fill(bitmask, live[0]) else (None, [])
    _batch_filler().batch_fill_next_token_bitmask([matchers[i]._matcher for i in live], bitmask, live)
    return bitmask, live


def argmax_allowed(logits: torch.Tensor, bitmask: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
    """Each row's argmax `[rows]` int64, with the forbidden tokens of `rows` (by `bitmask`, `fill_rows`') read as
    -inf: the greedy choice `apply_bitmask` then an argmax give (first maximum, NaN counting as the maximum), without
    writing `logits` (on the CPU one pass of hf_accel's kernel; elsewhere the mask applied to a copy)."""
    if not rows:
        return argmax_rows(logits)
    kernel = masked_argmax_kernel() if logits.device.type == "cpu" and logits.stride(-1) == 1 else None
    if kernel is None:
        logits = logits.clone()
        apply_bitmask(logits, bitmask, rows)
        return argmax_rows(logits)
    return kernel(logits, bitmask, _row_indices(tuple(rows)))


def step_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """This thread's bitmask of `rows` rows over `vocab_size` tokens, for a caller that writes every row it reads
    (made once per shape and reused: a new one is a `torch.full` a step; its contents are the last caller's)."""
    cache = getattr(_this_thread, "bitmasks", None)
    if cache is None:
        cache = _this_thread.bitmasks = {}
    bitmask = cache.get((rows, vocab_size))
    if bitmask is None:
        if len(cache) >= 64:  # batch sizes come and go: a bounded set
            cache.clear()
        bitmask = cache[rows, vocab_size] = token_bitmask(rows, vocab_size)
    return bitmask


_this_thread = threading.local()


def _batch_filler() -> Any:
    """This thread's xgrammar `BatchGrammarMatcher` (one per engine loop: they may fill at the same time), filling
    on one thread (more took the decoding step's cores on 2 of them)."""
    filler = getattr(_this_thread, "filler", None)
    if filler is None:
        filler = _this_thread.filler = xgrammar().BatchGrammarMatcher(max_threads=1)
    return filler
