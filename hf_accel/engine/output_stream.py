"""`OutputStream`: the one bridge from the engine's stepping thread to asyncio, for `Engine.stream` and the server.

Rules:
- the engine calls a request's listener in its own thread; the listener only posts the report to the event loop
  that created the stream;
- when that loop is closed nobody listens any more: the request is aborted, so its blocks return to the pool at the
  engine's next step;
- `updates()` yields `(key, report)` until every request added under a key has finished, and raises
  `EngineDeadError` if the engine's loop dies; leaving it early (consumer gone, task cancelled, error) aborts every
  unfinished request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Hashable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from .errors import EngineDeadError
from .outputs import RequestOutput, RequestOutputKind
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..lora.config import LoRARequest


class RequestSink(Protocol):
    """What a stream needs of an engine (`Engine` is one): adding a request with a listener, and aborting it."""

    def add_request(self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
                    listener: Callable[[RequestOutput | BaseException], None],
                    output_kind: RequestOutputKind, lora_request: LoRARequest | None = None) -> str: ...

    def abort(self, request_id: str) -> None: ...


class OutputStream:
    """The reports of a group of engine requests, one per key, read by one asyncio consumer."""

    def __init__(self, engine: RequestSink, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.engine, self.output_kind = engine, output_kind
        self._loop = asyncio.get_running_loop()
        self._reports: asyncio.Queue[tuple[Hashable, RequestOutput | BaseException]] = asyncio.Queue()
        self._open: dict[Hashable, str] = {}  # key -> id of its request, added and not finished

    @property
    def num_open(self) -> int:
        return len(self._open)

    def add(self, key: Hashable, prompt: str | list[int], params: SamplingParams | None,
            request_id: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Add a request reporting under `key` (with `lora_request`'s adapter, if given); returns its id (the
        engine's ValueError / TypeError pass through)."""
        request_id = self.engine.add_request(prompt, params, request_id, listener=partial(self._post, key),
                                             output_kind=self.output_kind, lora_request=lora_request)
        self._open[key] = request_id
        return request_id

    async def updates(self) -> AsyncIterator[tuple[Hashable, RequestOutput]]:
        """`(key, report)` after every engine step that changes a request, until all have finished."""
        try:
            while self._open:
                key, out = await self._reports.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError("the engine loop died") from out
                if out.finished:
                    self._open.pop(key, None)
                yield key, out
        finally:
            self.close()

    def close(self) -> None:
        """Abort every unfinished request (idempotent)."""
        for request_id in self._open.values():
            self.engine.abort(request_id)
        self._open.clear()

    def _post(self, key: Hashable, out: RequestOutput | BaseException) -> None:  # in the engine's thread
        try:
            self._loop.call_soon_threadsafe(self._reports.put_nowait, (key, out))
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            if isinstance(out, RequestOutput) and not out.finished:
                self.engine.abort(out.request_id)


async def stream_request(engine: RequestSink, prompt: str | list[int], params: SamplingParams | None,
                         request_id: str | None, output_kind: RequestOutputKind,
                         lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
    """One request's reports as they come (`Engine.stream`, `EngineProcess.stream`); leaving early aborts it."""
    stream = OutputStream(engine, output_kind)
    stream.add(0, prompt, params, request_id, lora_request)
    async with contextlib.aclosing(stream.updates()) as updates:  # closing this generator aborts at once
        async for _, out in updates:
            yield out
