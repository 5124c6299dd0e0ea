"""`StructuredLogitsProcessor`: generate's next-token scores masked to what each row's grammar allows.

One xgrammar `GrammarMatcher` per row (`TokenMatcher`). At each call, every row's matcher follows the row's output so
far (the tokens after its prompt, which the first call sees), then fills the row's bit of one `[rows, vocab]`
bitmask, which is applied to the scores in place: tokens the grammar forbids get -inf, so greedy and sampling both
choose among the allowed ones (sampling from the target's distribution renormalised over them).

Following the row's tokens rather than one new token per call is what lets speculative decoding use the processor:
its loops score each candidate position with the candidates before it appended, and the next round starts from the
accepted ones, so the matcher rolls back what was rejected and advances over what was kept. hf_accel's speculative
loops call `ragged_call` with each row's length (their batches are ragged: each row right-aligned, left-padded);
transformers' loops keep rows the same length. A row whose grammar is complete allows only its stop tokens; past a
stop (generate pads a finished row) or a candidate the grammar refuses, the row's mask allows everything: those
scores are never used. Rows are generate's rows in order, so beam search (which reorders them) is refused by the
caller.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from .forced_spelling import ForcedSpelling
from .matcher import TokenMatcher, apply_bitmask, token_bitmask


class StructuredLogitsProcessor(LogitsProcessor):
    """Masks generate's scores to `compiled` (an xgrammar `CompiledGrammar`), one matcher per row, created at the
    first call (which sees the prompts) for as many rows as it sees; `jump_forward`: hf_accel's speculative loops
    draft the tokens the grammar forces (`forced_tokens`; `speculative/jump_forward.py`), spelled as the model
    wrote that text before where `spelling` has seen it (`forced_spelling.py`)."""

    def __init__(self, compiled: Any, jump_forward: bool = True, spelling: ForcedSpelling | None = None):
        self.compiled, self.jump_forward, self.spelling = compiled, jump_forward, spelling
        self.matchers: list[TokenMatcher] = []
        self.prompt_lengths: list[int] = []
        self.bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`input_ids` `[rows, width]`: each row's tokens so far (generate's rows: all the same length)."""
        return self.ragged_call(input_ids, scores, None)

    def ragged_call(self, input_ids: torch.LongTensor, scores: torch.FloatTensor,
                    lengths: torch.Tensor | None) -> torch.FloatTensor:
        """As `__call__` for a ragged batch: row r's last `lengths[r]` columns are its tokens, the rest left padding
        (None: all columns). hf_accel's speculative loops call this (`TokenRules.process`)."""
        apply_bitmask(scores, self.allowed(input_ids, lengths))
        return scores

    def allowed(self, input_ids: torch.LongTensor, lengths: torch.Tensor | None = None,
                appended: bool = False) -> torch.Tensor:
        """Each row's matcher advanced over the row's output in `input_ids` (ragged as in `ragged_call`), and the
        bitmask `[rows, ceil(vocab / 32)]` int32 of the tokens each allows next (this processor's own buffer,
        refilled in place at every call). Compiled generate applies it inside its step (`token_choice.masked`).
        `appended`: the caller promises each row gained exactly one token since the previous call and nothing
        before it changed (compiled generate's loop), so only `input_ids`' last column is read."""
        rows, width = input_ids.shape
        if appended and self.matchers and lengths is None:
            return self._allowed_after(input_ids)
        lengths = [width] * rows if lengths is None else lengths.tolist()
        if not self.matchers:
            self.matchers = [TokenMatcher(self.compiled, self.spelling) for _ in range(rows)]
            self.prompt_lengths = lengths
            self.bitmask = token_bitmask(rows, self.compiled.tokenizer_info.vocab_size)
        for row, output in enumerate(self._outputs(input_ids, lengths)):
            self._fill(row, self.matchers[row].follow(output))
        return self.bitmask

    def _allowed_after(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """`allowed` where each row appended one token (`input_ids`' last column): a row whose matcher followed
        every token before it accepts just that one (one refused earlier re-reads its output, as `follow` does)."""
        width, last = input_ids.shape[1], input_ids[:, -1].tolist()
        for row, (matcher, prompt) in enumerate(zip(self.matchers, self.prompt_lengths)):
            if matcher.is_terminated:  # its stop accepted: generate pads the row from there
                self._fill(row, False)
            elif matcher.num_accepted == width - prompt - 1:
                self._fill(row, matcher.advance(last[row]))
            else:
                self._fill(row, matcher.follow(input_ids[row, prompt:].tolist()))
        return self.bitmask

    def _fill(self, row: int, fits: bool) -> None:
        """Row `row` of the bitmask: what its grammar allows next where its output `fits`, else everything (after a
        stop, which generate pads, or a refused candidate: never verified past)."""
        if fits:
            self.matchers[row].fill(self.bitmask, row)
        else:
            self.bitmask[row].fill_(-1)

    def _outputs(self, input_ids: torch.LongTensor, lengths: list[int]) -> list[list[int]]:
        """Each row's output so far: its tokens after its prompt (`input_ids` ragged by `lengths`)."""
        width = input_ids.shape[1]
        starts = [width - length + prompt for length, prompt in zip(lengths, self.prompt_lengths)]
        first = max(min(starts), 0)  # only the columns after the prompts go to Python
        return [tokens[max(start - first, 0):] for start, tokens in zip(starts, input_ids[:, first:].tolist())]

    def mask_candidates(self, input_ids: torch.LongTensor, lengths: torch.Tensor, candidates: torch.Tensor,
                        num_candidates: torch.Tensor | None, scores: torch.Tensor) -> bool:
        """What `ragged_call` does at each of a speculative round's `k + 1` positions, at once, in place: `scores`
        `[rows, k + 1, vocab]`, position j of row r masked to what its grammar allows after its output (in
        `input_ids`, ragged by `lengths` as in `ragged_call`) and its first j `candidates` `[rows, k]` (of
        `num_candidates[r]`; None: all k); one bitmask for every position, filled row by row (`fill_drafts`), one
        mask. Positions past a row's candidates, or past one its grammar refuses, allow everything (never used).
        False, with nothing done, before the call's first `ragged_call` (which sees the prompts)."""
        if not self.matchers:
            return False
        rows, positions = scores.shape[0], scores.shape[1]
        bitmask = token_bitmask(rows * positions, self.compiled.tokenizer_info.vocab_size)
        drafts = candidates.tolist()
        counts = [positions - 1] * rows if num_candidates is None else num_candidates.tolist()
        for row, output in enumerate(self._outputs(input_ids, lengths.tolist())):
            if self.matchers[row].follow(output):
                self.matchers[row].fill_drafts(drafts[row][: counts[row]], bitmask, row * positions)
        apply_bitmask(scores.view(rows * positions, -1), bitmask)
        return True

    def forced_tokens(self, row: int, output: list[int]) -> list[int]:
        """The tokens row `row`'s grammar forces after its `output` so far (the only continuation it allows, in the
        vocabulary's longest tokens); empty where the next token is a choice, past a stop, or before the first call."""
        if row >= len(self.matchers) or not self.matchers[row].follow(output):
            return []
        return self.matchers[row].forced_tokens()
