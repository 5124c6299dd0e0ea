"""One HTTP request on the engine: its engine requests (one per prompt) reporting deltas through one
`OutputStream`, the server's bound on requests waiting for their first token, and each choice's text so far.

Rules:
- the engine reports only what is new (`RequestOutputKind.DELTA`): a choice's token ids ride with its text;
- a request counts as waiting from admission until its first report (queued in the engine or prefilling); admitting
  more than `max_len` waiting requests is refused with 429 before anything reaches the engine;
- leaving `EngineRequests.deltas` early (client gone, task cancelled, error) aborts every unfinished engine
  request, so its blocks return to the pool at the engine's next step;
- an engine request that failed alone (`RequestOutput.error`) ends the HTTP request with `request_failed` (400 or
  500), aborting its other prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from ..engine.output_stream import OutputStream, RequestSink
from ..engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind, TokenLogprob
from ..engine.sampling_params import SamplingParams
from ..lora.config import LoRARequest
from .adapters import ServedAdapters
from .errors import APIError, request_failed
from .responses import Usage

T = TypeVar("T")


@dataclass(slots=True)
class WaitingRequests:
    """Requests admitted by the server that have no output yet; touched only on the event loop."""

    max_len: int
    num_waiting: int = 0

    def admit(self, num: int) -> None:
        if self.num_waiting + num > self.max_len:
            raise APIError(429, f"The server's queue is full ({self.num_waiting} requests waiting for their first "
                                f"token, max_queue_len={self.max_len}); retry later.", code="queue_full",
                           error_type="rate_limit_error")
        self.num_waiting += num

    def release(self, num: int) -> None:
        self.num_waiting -= num


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained in one report: text, token ids and their logprobs; `finish_reason` once. As a whole
    choice (`Choices.whole`), everything it produced."""

    index: int
    text: str
    text_offset: int  # characters of the choice's text before this delta
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def extend(self, sample: CompletionOutput) -> None:
        self.text += sample.text
        self.token_ids += sample.token_ids
        if sample.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs += sample.logprobs
        self.finish_reason, self.stop_reason = sample.finish_reason, sample.stop_reason


@dataclass(slots=True)
class Choices:
    """Every choice of one HTTP request so far (choice `prompt_index * n + sample index`) and its prompts' sizes."""

    n: int
    whole: dict[int, ChoiceDelta] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        """Record a DELTA report of prompt `prompt_index`; returns its choices' deltas."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        deltas = []
        for sample in out.outputs:
            index = prompt_index * self.n + sample.index
            so_far = self.whole.setdefault(index, ChoiceDelta(index, "", 0, [], None))
            deltas.append(ChoiceDelta(index, sample.text, len(so_far.text), sample.token_ids, sample.logprobs,
                                      sample.finish_reason, sample.stop_reason))
            so_far.extend(sample)
        return deltas

    def in_order(self) -> list[ChoiceDelta]:
        return [self.whole[index] for index in sorted(self.whole)]

    def usage(self) -> Usage:
        """OpenAI's usage: prompt tokens once per prompt, completion tokens over every choice."""
        prompt = sum(self.prompt_tokens.values())
        completion = sum(len(choice.token_ids) for choice in self.whole.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class EngineRequests:
    """The engine requests of one HTTP request, one per prompt, `{base_id}-{prompt index}`, with `n` samples each,
    run by the base or by the LoRA adapter `lora_request` (held in `adapters` from `submit` to `close`, so
    unloading it waits for them)."""

    def __init__(self, engine: RequestSink, waiting: WaitingRequests, base_id: str, n: int,
                 lora_request: LoRARequest | None = None, adapters: ServedAdapters | None = None):
        self.waiting, self.base_id = waiting, base_id
        self.lora_request, self.adapters = lora_request, adapters
        self.choices = Choices(n)
        self._stream = OutputStream(engine, RequestOutputKind.DELTA)
        self._waiting: set[int] = set()  # prompts counted in `waiting`
        self._holding = False  # whether this holds its adapter in `adapters`

    def submit(self, prompts: Sequence[str | list[int]], params: SamplingParams) -> None:
        """Admit and add every prompt; on any error nothing stays in the engine (429 when the queue is full,
        the engine's ValueError / TypeError / EngineDeadError otherwise)."""
        self.waiting.admit(len(prompts))
        self._waiting = set(range(len(prompts)))
        if self.adapters is not None:
            self.adapters.hold(self.lora_request)
            self._holding = True
        try:
            for index, prompt in enumerate(prompts):
                self._stream.add(index, prompt, params, f"{self.base_id}-{index}", self.lora_request)
        except BaseException:
            self.close()
            raise

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's delta as the engine reports it, until every prompt finishes. Raises `EngineDeadError` when
        the loop dies and `APIError` (`request_failed`) when one prompt's request fails."""
        try:
            async for index, out in self._stream.updates():
                if out.error is not None:
                    raise request_failed(out.error)
                if index in self._waiting:
                    self._waiting.discard(index)
                    self.waiting.release(1)
                for delta in self.choices.add(index, out):
                    yield delta
        finally:
            self.close()

    async def complete(self) -> list[ChoiceDelta]:
        """Every choice whole, in choice order, once all have finished."""
        async for _ in self.deltas():
            pass
        return self.choices.in_order()

    def close(self) -> None:
        """Abort what is still running, give back the waiting slots and the adapter (idempotent)."""
        self._stream.close()
        self.waiting.release(len(self._waiting))
        self._waiting.clear()
        if self._holding:
            self._holding = False
            self.adapters.release(self.lora_request)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (its engine requests abort) and raise."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cancellation runs (aborting its engine requests) before we answer
    if task.cancelled():
        raise APIError(400, "The client disconnected before the response was ready.", code="client_disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
