"""EAGLE-3 candidates in the engine (`SpeculativeConfig(method="eagle3", model=head)`, vLLM's method name).

Rules:
- every step returns the target's feature states at every token it computed (`StepForward(feature_layers=...)`);
  the proposer fuses them (`fc`, one matmul per step) and keeps them per sequence until the sequence proposes;
- only committed positions give features: a verify step's rows past the accepted candidates are dropped;
- to propose, one packed head pass catches every speculating sequence up on its waiting entries (entry t: the fused
  feature of position t with token t + 1), and its output at the last one reads out draft 1; each further draft is
  one packed head pass of one entry per sequence still drafting (entry P + j - 1: the head's previous output with
  draft j, P the position of the sequence's last token), in the slots the scheduler allocated for the candidates;
  chains grow and end as `draft_chain.py` says. Sequences that do not speculate (a large batch) pay only the fusion;
- the head's K/V lives in a one-layer pool of its own addressed by the target's block tables (vLLM's layout): entry
  t sits in the slot of token t. Rejected candidates' slots are overwritten later, as the target's are. A
  prefix-cache hit's positions keep whatever head entries their blocks hold (written if the sequence that computed
  them speculated after computing them, stale otherwise): drafts may be weaker there, output is unchanged.
The head attends through the engine's paged attention (`hf_accel_step`, the kernel where it is built); its pass and
readout are compiled when the engine's step is (two graphs, traced at start; in the engine-core process, warm passes
skip dynamo's guards as the step's do: `step_forward.warm_guards`).
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as symbolic_config
from transformers import PreTrainedModel

from ...cache.kv_shape import KVShape
from ...speculative.eagle_head import EagleHead, token_embeddings
from ...runtime.attention import ATTENTION_NAME, StepAttention
from ...runtime.frozen_graphs import compiled_for, step_graph_settings
from ...runtime.kv_pool import KVPool
from ..sequence import Sequence
from ...runtime.dynamo import dynamo_settings, warm_guards
from ...runtime.step_inputs import StepInputs
from .draft_chain import MIN_DRAFT_PROBABILITY, grow_chains
from .proposer import Proposer


@dataclass(slots=True)
class _HeadRow:
    """One sequence's head state: entries written for positions below `written`; `waiting`, the fused features
    (`[n, H]` per step, in order) of positions `written .. end - 1`, whose entries are still to run."""

    written: int
    waiting: list[torch.Tensor] = field(default_factory=list)
    num_waiting: int = 0

    @property
    def end(self) -> int:
        """The first position without a feature."""
        return self.written + self.num_waiting

    def add(self, fused: torch.Tensor) -> None:
        self.waiting.append(fused)
        self.num_waiting += fused.shape[0]

    def keep_first(self, count: int) -> None:
        """Keep only the first `count` waiting features."""
        if count < self.num_waiting:
            self.waiting, self.num_waiting = ([torch.cat(self.waiting)[:count]] if count else []), count

    def take(self) -> torch.Tensor:
        """All waiting features `[m, H]`; the row has run them after."""
        waiting = torch.cat(self.waiting)
        self.written, self.waiting, self.num_waiting = self.end, [], 0
        return waiting


class EagleProposer(Proposer):
    """Proposes chains of up to `num_speculative_tokens` drafts with an `EagleHead` of the served `model` (see the
    module docstring). `allocate` gives it its K/V pool once the engine has sized the target's."""

    def __init__(self, head: EagleHead, model: PreTrainedModel, num_speculative_tokens: int):
        if not isinstance(head, EagleHead):
            raise TypeError(f"`model` must be a hf_accel.EagleHead for method 'eagle3', got {type(head).__name__}")
        head.check_compatible(model)
        self.head, self.model = head.eval(), model
        self.num_speculative_tokens = num_speculative_tokens
        self.feature_layers = tuple(head.config.feature_layers)
        self.shape = KVShape.from_config(head.midlayer.self_attn.config, caller="the EAGLE head", argument="head")
        self.kv: KVPool | None = None
        self.attend = None
        self.compiled, self.compile_seconds = False, 0.0
        self._warm = False  # both graphs traced: passes may skip dynamo's guards (`warm_guards`)
        self._step = head_step
        self._rows: dict[int, _HeadRow] = {}

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What the head's pool costs per token (the engine's K/V budget covers it)."""
        return self.shape.bytes_per_token(dtype)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, attend,
                 compile: bool = False) -> None:
        """The head's one-layer pool, the target's `num_blocks` blocks of `block_size`, attended by `attend`; with
        `compile`, the head's pass and readout run through inductor (two graphs, one token and several, traced now
        into `compile_seconds`; the head's and the target's weights frozen in, as the engine step's are)."""
        self.kv = KVPool(self.shape, num_blocks, block_size, dtype, device)
        self.attend = attend
        if compile:
            self._compile(device)

    def _compile(self, device: torch.device) -> None:
        """Compile the head's pass and trace both graphs now; where that fails, warn and run it eagerly (as the
        engine step does)."""
        started = time.perf_counter()
        self._step = compiled_for(self.head, head_step, "engine head step",
                                  lambda function: torch.compile(function, dynamic=True, fullgraph=True),
                                  companions=(self.model,))
        self.compiled = True
        try:
            with dynamo_settings(), step_graph_settings(True, self.head.dtype), torch.inference_mode():
                self._trace_both_graphs(device)
            self._warm = True
        except Exception as error:
            warnings.warn(f"hf_accel: compiling the EAGLE head's pass failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); the head runs eagerly",
                          RuntimeWarning, stacklevel=3)
            self.compiled, self._step = False, head_step
        self.compile_seconds = time.perf_counter() - started

    def _trace_both_graphs(self, device: torch.device) -> None:
        """One entry, then three (two sequences), all in block 0 of the empty pool."""
        for count in (1, 3):
            features = torch.zeros(count, self.head.config.hidden_size, dtype=self.head.dtype, device=device)
            spans = [range(0, 1)] if count == 1 else [range(0, 1), range(0, 2)]
            self._pass(features, [0] * count, [([0], span) for span in spans])

    @property
    def num_tracked(self) -> int:
        return len(self._rows)

    def can_propose(self, seq: Sequence) -> bool:
        """Whether the head can draft after `seq`'s last token: it can speculate, every computed position since its
        first has a feature, and the last one's entry is still to run (its output reads out draft 1)."""
        row = self._rows.get(seq.seq_id)
        return (seq.can_speculate and row is not None and row.end == seq.num_computed_tokens
                and row.num_waiting > 0)

    def take_features(self, committed: list[tuple[Sequence, int, torch.Tensor]]) -> None:
        """`committed`: per sequence, the first position a step committed and the target's features there `[n, F]`;
        fused in one matmul and kept until the sequence proposes."""
        committed = [(seq, first, features) for seq, first, features in committed if features.shape[0]]
        if not committed:
            return
        with torch.inference_mode():
            fused = self.head.fc(torch.cat([f for _, _, f in committed]).to(self.head.dtype))
        end = 0
        for seq, first, features in committed:
            row = self._row_from(seq.seq_id, first)
            row.add(fused[end : end + features.shape[0]])
            end += features.shape[0]

    def forget(self, seq: Sequence) -> None:
        self._rows.pop(seq.seq_id, None)

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Per sequence, a chain of at most `num_drafts[i]` head drafts after its last token: one packed catch-up
        pass, then one head pass per further draft, packed over the sequences still drafting."""
        with torch.inference_mode():
            hidden, first, sure = self._catch_up(seqs)  # each sequence's output at its last entry, its draft 1

            def extend(j: int, going: list[int], keep: list[int], last: list[int]) -> tuple[list[int], list[bool]]:
                nonlocal hidden  # row n: going[n]'s output in the previous pass
                # entry P + j - 1 of each (P: its last token's position) reads its last output with draft j
                entries = [(seqs[i].block_ids, range(seqs[i].num_computed_tokens + j - 1,
                                                     seqs[i].num_computed_tokens + j)) for i in going]
                hidden, tokens, confident = self._pass(hidden[keep], last, entries)
                return tokens, confident

            return grow_chains(first, sure, num_drafts, extend)

    def _row_from(self, seq_id: int, position: int) -> _HeadRow:
        """`seq_id`'s row, ready to take features from `position` on: a new row when there is none or `position`
        lies past its end (positions never computed); cut back to `position` when it is recomputed (preemption)."""
        row = self._rows.get(seq_id)
        if row is None or position > row.end:
            row = self._rows[seq_id] = _HeadRow(position)
        elif position < row.written:
            row.written, row.waiting, row.num_waiting = position, [], 0
        else:
            row.keep_first(position - row.written)  # a no-op unless recomputing
        return row

    def _catch_up(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int], list[bool]]:
        """Run every sequence's waiting entries in one pass; `_pass`'s result at each one's last entry."""
        rows = [self._rows[seq.seq_id] for seq in seqs]
        spans = [range(row.written, row.end) for row in rows]
        tokens = [seq.token_ids[p + 1] for seq, span in zip(seqs, spans) for p in span]
        entries = [(seq.block_ids, span) for seq, span in zip(seqs, spans)]
        return self._pass(torch.cat([row.take() for row in rows]), tokens, entries)

    def _pass(self, features: torch.Tensor, tokens: list[int],
              entries: list[tuple[list[int], range]]) -> tuple[torch.Tensor, list[int], list[bool]]:
        """The head over packed entries (`features` `[total, H]`, `tokens`: one per entry; `entries`: per sequence,
        its block ids and the positions of its entries, consecutive) through the head's pool -> per sequence, the
        output at its last entry `[rows, H]`, the draft read off it, and whether the head gave it
        `MIN_DRAFT_PROBABILITY`."""
        device = features.device
        inputs = StepInputs.packed(tokens, entries, self.kv.block_size)
        rows = len(entries)
        if self.compiled:
            inputs = inputs.padded()  # sizes that could be 1 (but the token count) never are: two graphs in all
        step = inputs.attention(self.kv, self.attend, device)
        tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        with self.head.attention_implementation(ATTENTION_NAME), symbolic_config.patch(use_duck_shape=False), \
                warm_guards(self._warm):
            hidden, token, confidence = self._step(self.model, self.head, features, tensor(inputs.tokens),
                                                   tensor(inputs.positions), step, tensor(inputs.keep))
        return hidden[:rows], token[:rows].tolist(), (confidence[:rows] >= MIN_DRAFT_PROBABILITY).tolist()


def head_step(model: PreTrainedModel, head: EagleHead, features: torch.Tensor, tokens: torch.Tensor,
              positions: torch.Tensor, attention: StepAttention,
              keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head over packed entries (`features` `[total, H]`, `tokens` and `positions` `[total]`) attending through
    `attention` -> at the rows `keep`: outputs `[rows, H]`, argmax drafts `[rows]` and the probability the head gave
    them `[rows]`."""
    out = head(features[None], token_embeddings(model, tokens[None]), positions[None], None, None,
               hf_accel_step=attention)[0, keep]
    confidence, token = torch.softmax(head.logits(model, out), dim=-1).max(dim=-1)
    return out, token, confidence
