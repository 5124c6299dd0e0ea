"""`POST /v1/completions`: OpenAI's text completions over the engine (streamed or not)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import TokenLogprob
from .errors import bad_request
from .generation import ChoiceDelta, full_choices, unless_disconnected, usage
from .protocol import CompletionRequest
from .state import ServerState, server_state
from .streaming import sse_response, stream_choices

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request,
                            server: ServerState = Depends(server_state)) -> Response:
    server.check_model(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(ValueError("`best_of` other than `n` is not supported by this server"))
    try:
        params = body.sampling_params(body.max_tokens, body.logprobs)
        response_id, requests = server.new_requests("cmpl")
        requests.submit(body.prompts, params)
    except (ValueError, TypeError) as error:
        raise bad_request(error) from error
    header = {"id": response_id, "object": "text_completion", "created": int(time.time()),
              "model": server.model_name}

    def choice(delta: ChoiceDelta) -> dict:
        logprobs = None if delta.logprobs is None else completion_logprobs(server, delta.logprobs, delta.text_offset)
        extra = {"token_ids": delta.token_ids} if body.return_token_ids else {}
        return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason, **extra}

    if body.stream:
        usage_chunk = (lambda counts: {**header, "choices": [], "usage": counts}) if body.include_usage else None
        return sse_response(stream_choices(requests, body.n, lambda d: {**header, "choices": [choice(d)]},
                                           usage_chunk))
    outputs = await unless_disconnected(request, requests.final_outputs())
    return JSONResponse({**header, "choices": [choice(d) for d in full_choices(outputs, body.n)],
                         "usage": usage(outputs)})


def completion_logprobs(server: ServerState, logprobs: list[TokenLogprob], text_offset: int) -> dict:
    """OpenAI's legacy logprobs: token strings, their logprobs, the top alternatives, and text offsets."""
    tokens = [server.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{server.token_text(t): value for t, value in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
