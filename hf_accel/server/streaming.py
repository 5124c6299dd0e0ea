"""Server-sent events: `data: {json}\\n\\n` per chunk (one choice each), an optional usage chunk, `data: [DONE]`.

If the engine dies mid-stream, or the request fails in the engine, the stream ends with an error event in OpenAI's
shape before `[DONE]`. However the response ends (finished, client gone before the first event, cancelled), its
engine requests are closed: aborted if unfinished, their waiting slots and LoRA adapter given back.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from ..engine.errors import EngineDeadError
from .errors import APIError, engine_dead
from .generation import ChoiceDelta, EngineRequests
from .responses import Usage

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that calls `on_close` however it ends. Starlette cancels the body's iteration when the
    client is gone, possibly before the generator has started, and a generator that never started never runs its
    `finally`: the close cannot live there alone."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse_response(events: AsyncIterator[str], requests: EngineRequests) -> StreamingResponse:
    """The event stream of `requests` (closed when the response ends, however it ends)."""
    return ClosingStreamingResponse(events, requests.close, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})


async def stream_choices(requests: EngineRequests, chunk: Callable[[ChoiceDelta], BaseModel | None],
                         usage_chunk: Callable[[Usage], BaseModel] | None,
                         first: Sequence[BaseModel] = ()) -> AsyncIterator[str]:
    """Events of one streamed request: `first` chunks, then one chunk per choice delta as the engine produces
    them (none where `chunk` gives None: a delta it holds back), then (with `usage_chunk`) the usage, then `[DONE]`.
    Closing the stream early aborts the engine requests."""
    try:
        for payload in first:
            yield event(payload)
        async for delta in requests.deltas():
            payload = chunk(delta)
            if payload is not None:
                yield event(payload)
        if usage_chunk is not None:
            yield event(usage_chunk(requests.choices.usage()))
    except EngineDeadError as error:
        yield event(engine_dead(error.reason).body())
    except APIError as error:
        yield event(error.body())
    finally:
        requests.close()
    yield DONE
