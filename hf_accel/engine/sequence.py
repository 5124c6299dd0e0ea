"""One record per request and per sample: the state the scheduler, block manager and runner share.

A `Request` holds `n` `Sequence`s (its samples). A sequence's tokens are its prompt followed by its output; the
first `num_computed_tokens` of them have K/V in the sequence's blocks. The sequence samples a token in a step
exactly when that step computes its last token (`num_computed_tokens` reaches `num_tokens`); a fresh request and
one resumed after preemption run the same rule. With speculation, a decoding sequence may also compute candidates
after its last token in the same step (`ScheduledSeq.draft_token_ids`: never part of `token_ids` until accepted).
"""

from __future__ import annotations

import copy
import enum
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .detokenizer import Detokenizer
from .outputs import CompletionOutput, RequestError, RequestOutput, RequestOutputKind, RequestTiming, TokenLogprob
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..lora.config import LoRARequest
    from ..structured.matcher import TokenMatcher

_sequence_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One sample of a request: its tokens, blocks and decoding state."""

    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    detokenizer: Detokenizer | None
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    output: CompletionOutput = field(init=False)
    num_reported_tokens: int = 0  # output tokens (and their text) handed out in DELTA reports
    num_reported_chars: int = 0
    is_finish_reported: bool = False
    grammar: TokenMatcher | None = None  # with `structured_outputs`: where the sample is in its grammar

    def __post_init__(self) -> None:
        logprobs = [] if self.request.params.logprobs is not None else None
        self.output = CompletionOutput(index=self.index, token_ids=[], text="", logprobs=logprobs)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_tokens_left(self) -> int:
        """Output tokens it may still produce under `max_tokens`."""
        return self.params.max_tokens - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def can_speculate(self) -> bool:
        """Whether candidates may be verified for it now: decoding, and room for a candidate (the step's last
        verified position also yields a token). Each proposer adds its own conditions."""
        return self.num_uncomputed_tokens == 1 and self.num_tokens_left > 1

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority (lower first), then arrival, then sample index."""
        return self.request.params.priority, self.request.arrival_seq, self.index

    def append_token(self, token_id: int, logprob: TokenLogprob | None, now: float) -> str | None:
        """Record a sampled token (its grammar, if any, advances over it first: ValueError if it does not fit);
        returns the stop string it completed, if any."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.token_ids.append(token_id)
        self.output.token_ids.append(token_id)
        self.output.token_times.append(now)
        if logprob is not None and self.output.logprobs is not None:
            self.output.logprobs.append(logprob)
        if self.detokenizer is None:
            return None
        stop = self.detokenizer.add(token_id)
        self.output.text = self.detokenizer.text[: self.detokenizer.released]
        return stop

    def take_delta(self) -> CompletionOutput | None:
        """What the sample gained since its last delta (`RequestOutputKind.DELTA`'s rule), or None."""
        out, tokens, chars = self.output, self.num_reported_tokens, self.num_reported_chars
        if self.is_finish_reported:
            return None
        has_news = len(out.text) > chars or (self.detokenizer is None and len(out.token_ids) > tokens)
        if not (has_news or out.finished):
            return None
        self.num_reported_tokens, self.num_reported_chars = len(out.token_ids), len(out.text)
        self.is_finish_reported = out.finished
        return CompletionOutput(out.index, out.token_ids[tokens:], out.text[chars:], out.finish_reason,
                                out.stop_reason, None if out.logprobs is None else out.logprobs[tokens:],
                                out.token_times[tokens:])

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        """End the sample; its held-back text is released, except after a stop string (which cut it) or an error
        (the detokenizer may be what failed: the text stays what was released)."""
        if self.detokenizer is not None and not isinstance(stop_reason, str) and reason != "error":
            self.detokenizer.finish()
            self.output.text = self.detokenizer.text
        self.status = SequenceStatus.FINISHED
        self.output.finish_reason, self.output.stop_reason = reason, stop_reason


@dataclass(eq=False, slots=True)
class Request:
    """A prompt and its parameters, with `params.n` samples in `sequences`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    timing: RequestTiming
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: RequestError | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    constraint_key: tuple[str, str] | None = None  # its `structured_outputs`' key (`StructuredOutput.key`)

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)

    @property
    def prefix_root(self) -> bytes | None:
        """The parent key of its first block in the prefix cache: None for the base model, its adapter's own (id
        and folder) for a LoRA request, so blocks are shared only between requests of the same adapter."""
        if self.lora_request is None:
            return None
        return hashlib.sha256(f"lora:{self.lora_request.lora_int_id}:{self.lora_request.lora_path}".encode()).digest()

    def fail(self, error: BaseException) -> None:
        """End every sample with finish_reason "error" and keep why (`RequestError.from_exception`); samples not
        created yet are created finished, so the output still has `params.n` of them. Freeing blocks is the
        caller's."""
        self.error = RequestError.from_exception(error)
        for index in range(len(self.sequences), self.params.n):
            self.sequences.append(Sequence(self, index, list(self.prompt_token_ids), len(self.prompt_token_ids),
                                           generator=None, detokenizer=None))
        for seq in self.sequences:
            if not seq.is_finished:
                seq.finish("error")

    def snapshot(self) -> RequestOutput:
        """A copy of the request's whole output so far, safe to hand to another thread."""
        outputs = [copy.copy(seq.output) for seq in self.sequences]
        for out in outputs:
            out.token_ids = list(out.token_ids)
            out.token_times = list(out.token_times)
            out.logprobs = None if out.logprobs is None else list(out.logprobs)
        return self._output(outputs)

    def report(self) -> RequestOutput | None:
        """What its listener gets after a step that changed it, by `output_kind`; None when that kind says nothing
        now (FINAL_ONLY before the end, DELTA without news)."""
        if self.output_kind is RequestOutputKind.CUMULATIVE:
            return self.snapshot()
        if self.output_kind is RequestOutputKind.FINAL_ONLY:
            return self.snapshot() if self.is_finished else None
        deltas = [delta for seq in self.sequences if (delta := seq.take_delta()) is not None]
        return self._output(deltas) if deltas or self.is_finished else None

    def _output(self, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, copy.copy(self.timing),
                             self.num_cached_tokens, self.error, self.is_finished)


def make_sequences(request: Request, detokenizer_for) -> None:
    """Create the request's `params.n` samples (sample `i` seeded with `seed + i` when a seed is set)."""
    params = request.params
    for i in range(params.n):
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed + i)
        request.sequences.append(Sequence(
            request=request, index=i, token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids), generator=generator,
            detokenizer=detokenizer_for(params),
        ))
