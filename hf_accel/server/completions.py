"""`POST /v1/completions`: OpenAI's text completions over the engine (streamed or not)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ..engine.outputs import TokenLogprob
from .errors import bad_request
from .generation import ChoiceDelta, unless_disconnected
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from .state import ServerState, server_state
from .streaming import sse_response, stream_choices

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request,
                            server: ServerState = Depends(server_state)) -> CompletionResponse | StreamingResponse:
    """A completion per prompt and sample; with `stream`, server-sent chunks of one choice each."""
    server.model_adapter(body.model)  # 404 for an unknown model before anything else
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(ValueError("`best_of` other than `n` is not supported by this server"))
    try:
        params = body.sampling_params(body.max_tokens, body.logprobs)
        response_id, requests = server.new_requests("cmpl", body.n, body.model)
        requests.submit(body.prompts, params)
    except (ValueError, TypeError) as error:
        raise bad_request(error) from error
    created = int(time.time())

    def response(choices: list[CompletionChoice], counts: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=response_id, created=created, model=server.served_model(body.model),
                                  choices=choices, usage=counts)

    def choice(delta: ChoiceDelta) -> CompletionChoice:
        logprobs = None if delta.logprobs is None else completion_logprobs(server, delta.logprobs, delta.text_offset)
        return CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs,
                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                token_ids=delta.token_ids if body.return_token_ids else None)

    if body.stream:
        usage_chunk = (lambda counts: response([], counts)) if body.include_usage else None
        return sse_response(stream_choices(requests, lambda d: response([choice(d)]), usage_chunk), requests)
    choices = await unless_disconnected(request, requests.complete())
    return response([choice(d) for d in choices], requests.choices.usage())


def completion_logprobs(server: ServerState, logprobs: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: token strings, their logprobs, the top alternatives, and text offsets."""
    tokens = [server.token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=[{server.token_text(t): value for t, value in lp.top} for lp in logprobs],
        text_offset=offsets,
    )
