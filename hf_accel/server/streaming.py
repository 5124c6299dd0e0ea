"""Server-sent events: `data: {json}\\n\\n` per chunk (one choice each), an optional usage chunk, `data: [DONE]`.

If the engine dies mid-stream, or the request fails in the engine, the stream ends with an error event in OpenAI's
shape before `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..engine.errors import EngineDeadError
from .errors import APIError, engine_dead
from .generation import ChoiceDelta, EngineRequests
from .responses import Usage

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


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
