"""What every speculative `custom_generate` loop shares; a loop's drafter (draft model, EAGLE head, Medusa heads,
n-gram matcher) only makes each row's candidates, and the loop verifies them, one round (draft + verify, one target
forward) at a time.

- `GenerateCall`: what `generate` hands a custom generate loop, as one record.
- `TokenRules`: tokens are decided as plain `generate` decides them: the logits processors run on each row's compact
  tokens, then argmax or one multinomial draw; a row stops at the first token a stopping criterion fires on (EOS or
  any other; max length is the batch's own budget); scores and raw logits are kept per row when asked.
- `Decoding`: one call's state (`RaggedBatch`, rules, `SpeculativeStats`, streamer); `Decoding.start` builds it,
  `run` drives prefill then rounds until every row is finished (the models' Linears over packed panels, the streamer
  ended however the loop ends), `emit` streams and commits a round's tokens, `output` returns what `generate`
  returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..kernels.eager_packing import packed_linears
from ..runtime.host_argmax import argmax_rows
from .ragged_batch import RaggedBatch, batch_for_generate, stack_steps
from .stats import SpeculativeStats

State = TypeVar("State")


@dataclass(slots=True)
class GenerateCall:
    """The arguments `generate` passes a `custom_generate` callable (plus the streamer hf_accel's registry forwards)."""

    model: PreTrainedModel
    input_ids: torch.Tensor  # [batch, prompt_width], left-padded
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    generation_config: GenerationConfig
    streamer: BaseStreamer | None
    model_kwargs: dict[str, Any]  # attention_mask, past_key_values (the cache generate built), ...


@dataclass(slots=True)
class TokenRules:
    """How tokens are decided and rows stop, as plain `generate` does; collects scores per row when asked."""

    processors: LogitsProcessorList
    criteria: StoppingCriteriaList  # without MaxLengthCriteria (rows count their budget) and EosTokenCriteria
    eos_token_ids: torch.Tensor | None  # EosTokenCriteria's ids, checked for all rows at once
    do_sample: bool
    scores: list[list[torch.Tensor]] | None = None  # [row][step] processed scores [vocab]
    logits: list[list[torch.Tensor]] | None = None  # [row][step] raw logits [vocab]

    @property
    def has_stops(self) -> bool:
        return self.eos_token_ids is not None or len(self.criteria) > 0

    def process(self, input_ids: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Processed `scores` `[batch, vocab]` after `input_ids` `[batch, width]` (each row's `lengths[r]` tokens,
        right-aligned: `RaggedBatch.view`). A processor with a `ragged_call(input_ids, scores, lengths)` method
        (hf_accel's structured-output one, which follows each row's tokens) is given the lengths through it; the
        others are called as generate calls them."""
        for processor in self.processors:
            ragged = getattr(processor, "ragged_call", None)
            scores = processor(input_ids, scores) if ragged is None else ragged(input_ids, scores, lengths)
        return scores

    def grammar_only(self) -> Any:
        """The only processor, when it can mask a round's positions at once (`mask_candidates(input_ids, lengths,
        candidates, num_candidates, scores) -> bool`: hf_accel's `StructuredLogitsProcessor`); None otherwise."""
        only = self.processors[0] if len(self.processors) == 1 else None
        return only if callable(getattr(only, "mask_candidates", None)) else None

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """`[rows]` tokens from processed `scores` `[rows, vocab]`: argmax, or one multinomial draw per row."""
        if self.do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return argmax_rows(scores)

    def fires(self, batch: RaggedBatch, decided: torch.Tensor, scores: torch.Tensor,
              checked: torch.Tensor) -> torch.Tensor:
        """`[batch]` bool: a stopping criterion fires on the last of `decided` `[batch, n]` (each row's tokens after
        its history, the newest last; `scores` `[batch, vocab]` its processed scores), for the `checked` rows."""
        stop = torch.zeros_like(checked)
        if self.eos_token_ids is not None:
            stop |= torch.isin(decided[:, -1], self.eos_token_ids)
        if len(self.criteria) and bool(checked.any()):
            view = batch.view(batch.with_candidates(decided), batch.history_lengths + decided.shape[1])
            stop |= self.criteria(view, scores).to(stop.device)
        return stop & checked

    def collect(self, scores: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor,
                num_steps: torch.Tensor | None = None) -> None:
        """Keep processed `scores` and raw `logits` (`[batch, steps, vocab]`) of `rows` (indices) when generate
        asked for them: row r's first `num_steps[r]` steps (default all)."""
        for store, values in ((self.scores, scores), (self.logits, logits)):
            if store is None:
                continue
            for row in rows.tolist():
                store[row].extend(values[row] if num_steps is None else values[row, : int(num_steps[row])])


@dataclass(slots=True)
class Decoding:
    """The state every speculative loop keeps for one `generate` call."""

    batch: RaggedBatch
    rules: TokenRules
    stats: SpeculativeStats
    streamer: BaseStreamer | None

    @classmethod
    def start(cls, call: GenerateCall, stats: SpeculativeStats | None) -> Decoding:
        """A call's batch, token rules and stats (`stats`, else a new record), with the prompt put to the streamer."""
        config, rows = call.generation_config, call.input_ids.shape[0]
        batch, eos, criteria = batch_for_generate(call.input_ids, call.model_kwargs.get("attention_mask"), config,
                                                  call.stopping_criteria)
        record = config.return_dict_in_generate
        rules = TokenRules(call.logits_processor, criteria, eos, bool(config.do_sample),
                           [[] for _ in range(rows)] if record and config.output_scores else None,
                           [[] for _ in range(rows)] if record and config.output_logits else None)
        if call.streamer is not None:
            call.streamer.put(call.input_ids.cpu())
        return cls(batch, rules, stats if stats is not None else SpeculativeStats(), call.streamer)

    def run(self, prefill: Callable[[], State], one_round: Callable[[State], State],
            models: tuple[nn.Module | None, ...]) -> None:
        """`prefill()`, then `one_round(state)` until every row is finished, the Linears of `models` (target,
        drafter) over packed panels (`packed_linears`); the streamer ends however the loop ends."""
        try:
            with packed_linears(*models):
                state = prefill()
                while bool(self.batch.unfinished.any()):
                    state = one_round(state)
        finally:
            if self.streamer is not None:
                self.streamer.end()

    def emit(self, tokens: torch.Tensor, num_emitted: torch.Tensor, fired: torch.Tensor | None,
             num_to_stop: torch.Tensor) -> int:
        """Stream and commit a round's tokens (`RaggedBatch.commit`); returns M, the most tokens a row kept minus
        one."""
        if self.streamer is not None:  # batch size 1
            self.streamer.put(tokens[0, : int(num_emitted[0])].cpu())
        return self.batch.commit(tokens, num_emitted, fired, num_to_stop)

    def output(self, config: GenerationConfig, cache: Cache | None) -> GenerateDecoderOnlyOutput | torch.LongTensor:
        """What `generate` returns: `sequences` `[batch, prompt + new]` (finished rows padded), or with
        `return_dict_in_generate` a `GenerateDecoderOnlyOutput` with the scores / logits kept and `cache`."""
        batch = self.batch
        self.stats.num_new_tokens += int(torch.minimum(batch.num_generated, batch.limit).sum())
        num_steps = batch.num_output_tokens
        sequences = batch.tokens[:, : batch.prompt_width + num_steps]
        if not config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=stack_steps(self.rules.scores, num_steps),
                                         logits=stack_steps(self.rules.logits, num_steps), past_key_values=cache)
