"""Draft-model candidates in the engine (`SpeculativeConfig(method="draft", model=draft_model)`; vLLM's
"draft_model").

Rules:
- the draft model (a small causal LM over the served model's vocabulary) runs its own forward through the engine's
  paged attention (`StepForward`, compiled when the engine's step is) over a K/V pool of its own addressed by the
  target's block tables: position t of a sequence sits in the slot of token t in both pools;
- per sequence the proposer knows up to which position its pool holds the draft's K/V of committed tokens
  (`_DraftRow.written`). To propose after the last token at position P, one packed pass runs every speculating
  sequence's tokens from there to P (a sequence's first pass is its draft prefill) and reads draft 1 off the output
  at P; each further draft is one packed pass of one token per sequence still drafting, at P + j, in the slots the
  scheduler allocated for the candidates;
- the drafts run at P + 1, ... stay valid as far as the sequence then committed them (its accepted candidates): the
  next proposal starts after the last that matches. Where a sequence's blocks changed under a written position
  (preemption and recomputation), it starts again from the first changed block;
- chains grow and end as `draft_chain.py` says (as "eagle3"'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ...cache.kv_shape import KVShape, check_decoder_only
from ...runtime.kv_pool import KVPool
from ..sequence import Sequence
from ...runtime.step_forward import StepForward
from ...runtime.step_inputs import StepInputs
from .draft_chain import MIN_DRAFT_PROBABILITY, grow_chains
from .proposer import Proposer


@dataclass(slots=True)
class _DraftRow:
    """One sequence's draft state: K/V of its committed tokens at positions below `written`; `pending`, the drafts
    whose K/V were written at `written`, `written + 1`, ... (valid where the sequence committed those tokens);
    `blocks`, the sequence's block ids when they were written."""

    written: int = 0
    pending: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)

    def start(self, seq: Sequence, block_size: int) -> int:
        """The first position whose K/V the next pass must write for `seq`: after the written ones still valid,
        never past its last token (the pass reads draft 1 off it)."""
        written = self.written
        for token in self.pending:
            if written >= seq.num_computed_tokens or seq.token_ids[written] != token:
                break
            written += 1
        written = min(written, seq.num_computed_tokens)
        used = -(-written // block_size)  # blocks holding written positions
        changed = next((b for b in range(used) if b >= len(self.blocks) or self.blocks[b] != seq.block_ids[b]), None)
        return written if changed is None else min(written, changed * block_size)


class DraftProposer(Proposer):
    """Proposes chains of up to `num_speculative_tokens` drafts with a draft model of the served `model`'s
    vocabulary (see the module docstring). `allocate` gives it its K/V pool once the engine has sized the target's."""

    def __init__(self, draft: PreTrainedModel, model: PreTrainedModel, num_speculative_tokens: int):
        check_draft_model(draft, model)
        self.draft, self.num_speculative_tokens = draft.eval(), num_speculative_tokens
        self.shape = KVShape.from_config(draft.config, caller="the draft model", argument="model")
        self.kv: KVPool | None = None
        self.forward: StepForward | None = None
        self._rows: dict[int, _DraftRow] = {}

    @property
    def compiled(self) -> bool:
        return self.forward is not None and self.forward.compiled

    @property
    def compile_seconds(self) -> float:
        return 0.0 if self.forward is None else self.forward.compile_seconds

    @property
    def num_tracked(self) -> int:
        return len(self._rows)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What the draft's pool costs per token, in the draft's own dtype (the engine's K/V budget covers it)."""
        return self.shape.bytes_per_token(self.draft.dtype)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, attend,
                 compile: bool = False) -> None:
        """The draft's pool, the target's `num_blocks` blocks of `block_size`, attended by `attend`; with `compile`,
        its forward runs through inductor (two graphs, traced now into `compile_seconds`)."""
        self.kv = KVPool(self.shape, num_blocks, block_size, self.draft.dtype, device)
        self.forward = StepForward(self.draft, self.kv, attend, keep_hidden=False, compile=compile)
        self.forward.warm_up()

    def can_propose(self, seq: Sequence) -> bool:
        """Whether the draft can follow `seq`'s last token: whenever the sequence may speculate."""
        return seq.can_speculate

    def forget(self, seq: Sequence) -> None:
        self._rows.pop(seq.seq_id, None)

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Per sequence, a chain of at most `num_drafts[i]` drafts after its last token: one packed pass catching
        every sequence up to its last token, then one pass per further draft over the sequences still drafting."""
        size = self.kv.block_size
        rows = [self._rows.setdefault(seq.seq_id, _DraftRow()) for seq in seqs]
        spans = [range(row.start(seq, size), seq.num_computed_tokens + 1) for row, seq in zip(rows, seqs)]
        first, sure = self._pass([seq.token_ids[span.start : span.stop] for seq, span in zip(seqs, spans)],
                                 [(seq.block_ids, span) for seq, span in zip(seqs, spans)])

        def extend(j: int, going: list[int], keep: list[int], last: list[int]) -> tuple[list[int], list[bool]]:
            positions = [seqs[i].num_computed_tokens + j for i in going]  # draft j runs at P + j
            return self._pass([[token] for token in last],
                              [(seqs[i].block_ids, range(p, p + 1)) for i, p in zip(going, positions)])

        drafts = grow_chains(first, sure, num_drafts, extend)
        for seq, row, chain in zip(seqs, rows, drafts):
            row.written, row.pending = seq.num_computed_tokens + 1, chain[:-1]  # the last draft never ran
            row.blocks = list(seq.block_ids[: -(-(row.written + len(row.pending)) // size)])
        return drafts

    def _pass(self, tokens: list[list[int]], entries: list[tuple[list[int], range]]) -> tuple[list[int], list[bool]]:
        """The draft over packed tokens (`tokens[i]` at the positions `entries[i][1]` of a sequence with block ids
        `entries[i][0]`) -> per sequence, the argmax after its last token and whether the draft gave it
        `MIN_DRAFT_PROBABILITY`."""
        inputs = StepInputs.packed([t for row in tokens for t in row], entries, self.kv.block_size)
        confidence, token = torch.softmax(self.forward(inputs).logits, dim=-1).max(dim=-1)
        return token.tolist(), (confidence >= MIN_DRAFT_PROBABILITY).tolist()


def check_draft_model(draft: object, model: PreTrainedModel) -> None:
    """`TypeError` / `ValueError` naming `model` (the config's field) when `draft` cannot draft for `model`."""
    if not isinstance(draft, PreTrainedModel):
        raise TypeError(f"`model` must be a transformers PreTrainedModel (a small causal LM) for method 'draft', got "
                        f"{type(draft).__name__}")
    check_decoder_only(draft.config, "method 'draft'", "model")
    vocab, draft_vocab = (m.get_output_embeddings().weight.shape[0] for m in (model, draft))
    if vocab != draft_vocab:
        raise ValueError(f"the draft `model` predicts {draft_vocab} tokens, the served model {vocab}: they must share "
                         "a vocabulary")
    if not getattr(draft, "_supports_attention_backend", False):
        raise ValueError(f"the draft `model` ({type(draft).__name__}) does not use transformers' AttentionInterface, "
                         "which the engine needs")
