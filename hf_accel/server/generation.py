"""One HTTP request on the engine: its engine requests (one per prompt) reporting to one asyncio queue, the
server's bound on requests waiting for their first token, and the deltas between the engine's cumulative snapshots.

Rules:
- the engine calls listeners in its own thread; they only hand the snapshot to the request's event loop;
- a request counts as waiting from admission until its first output (queued in the engine or prefilling); admitting
  more than `max_len` waiting requests is refused with 429 before anything reaches the engine;
- leaving `EngineRequests.updates` early (client gone, task cancelled, error) aborts every unfinished engine
  request, so its blocks return to the pool at the engine's next step;
- an engine request that failed alone (`RequestOutput.error`) ends the HTTP request with `request_failed` (400 or
  500), aborting its other prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from fastapi import Request

from ..engine.engine import Engine, EngineDeadError
from ..engine.outputs import RequestOutput, TokenLogprob
from ..engine.sampling_params import SamplingParams
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


class EngineRequests:
    """The engine requests of one HTTP request, one per prompt, `{base_id}-{prompt index}`."""

    def __init__(self, engine: Engine, waiting: WaitingRequests, base_id: str):
        self.engine, self.waiting, self.base_id = engine, waiting, base_id
        self._loop = asyncio.get_running_loop()
        self._updates: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._open: set[int] = set()  # prompts added to the engine and not finished
        self._waiting: set[int] = set()  # prompts counted in `waiting`

    def submit(self, prompts: Sequence[str | list[int]], params: SamplingParams) -> None:
        """Admit and add every prompt; on any error nothing stays in the engine (429 when the queue is full,
        the engine's ValueError / TypeError / EngineDeadError otherwise)."""
        self.waiting.admit(len(prompts))
        self._waiting = set(range(len(prompts)))
        try:
            for index, prompt in enumerate(prompts):
                self.engine.add_request(prompt, params, f"{self.base_id}-{index}", listener=partial(self._post, index))
                self._open.add(index)
        except BaseException:
            self.close()
            raise

    async def updates(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`(prompt index, cumulative output)` after every engine step that changes one, until all finish. Raises
        `EngineDeadError` when the loop dies and `APIError` (`request_failed`) when one prompt's request fails."""
        try:
            while self._open:
                index, out = await self._updates.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError("the engine loop died") from out
                if out.error is not None:
                    self._open.discard(index)
                    raise request_failed(out.error)
                if index in self._waiting:
                    self._waiting.discard(index)
                    self.waiting.release(1)
                if out.finished:
                    self._open.discard(index)
                yield index, out
        finally:
            self.close()

    async def final_outputs(self) -> list[RequestOutput]:
        """Every prompt's finished output, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.updates():
            finals[index] = out
        return [finals[index] for index in sorted(finals)]

    def close(self) -> None:
        """Abort what is still running and give back the waiting slots (idempotent)."""
        for index in sorted(self._open):
            self.engine.abort(f"{self.base_id}-{index}")
        self._open.clear()
        self.waiting.release(len(self._waiting))
        self._waiting.clear()

    def _post(self, index: int, out: RequestOutput | BaseException) -> None:  # in the engine's thread
        try:
            self._loop.call_soon_threadsafe(self._updates.put_nowait, (index, out))
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained since it last reported: text, token ids and their logprobs; `finish_reason` once."""

    index: int
    text: str
    text_offset: int  # characters of the choice's text sent before this delta
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass(slots=True)
class DeltaTracker:
    """Turns cumulative snapshots into deltas per choice; choice `prompt_index * n + sample index`."""

    n: int
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # choice -> (characters, tokens) sent
    done: set[int] = field(default_factory=set)

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        """The choices of `out` with new text or a new finish; a choice's token ids ride with its text."""
        result = []
        for sample in out.outputs:
            index = prompt_index * self.n + sample.index
            chars, tokens = self.sent.get(index, (0, 0))
            if index in self.done or (len(sample.text) == chars and not sample.finished):
                continue
            logprobs = None if sample.logprobs is None else sample.logprobs[tokens:]
            result.append(ChoiceDelta(index, sample.text[chars:], chars, sample.token_ids[tokens:], logprobs,
                                      sample.finish_reason, sample.stop_reason))
            self.sent[index] = (len(sample.text), len(sample.token_ids))
            if sample.finished:
                self.done.add(index)
        return result


def full_choices(outputs: Sequence[RequestOutput], n: int) -> list[ChoiceDelta]:
    """Every choice of finished outputs whole, in choice order."""
    tracker = DeltaTracker(n)
    return [delta for index, out in enumerate(outputs) for delta in tracker.deltas(index, out)]


def usage(outputs: Sequence[RequestOutput]) -> Usage:
    """OpenAI's usage: prompt tokens once per prompt, completion tokens over every sample."""
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(sample.token_ids) for out in outputs for sample in out.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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
    if task.cancelled():
        raise APIError(400, "The client disconnected before the response was ready.", code="client_disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
