"""`POST /v1/chat/completions`: the messages through the tokenizer's chat template, then the engine."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ..engine.outputs import TokenLogprob
from .errors import bad_request
from .generation import ChoiceDelta, unless_disconnected
from .protocol import ChatCompletionRequest
from .responses import (
    AssistantMessage,
    CalledFunction,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprobEntry,
    ToolCallEntry,
    TopLogprob,
    Usage,
)
from .state import ServerState, server_state
from .streaming import sse_response, stream_choices
from .tool_replies import ReplyDeltas, reply_finish

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 server: ServerState = Depends(server_state)
                                 ) -> ChatCompletionResponse | StreamingResponse:
    """A reply per sample; with `stream`, a role chunk per choice, then content (or tool call) chunks of one choice
    each."""
    server.check_model(body.model)
    try:
        tools = body.tool_plan(server.tokenizer)
    except ValueError as error:
        raise bad_request(error) from error
    prompt = server.chat_prompt([m.template_dict() for m in body.messages], body.add_generation_prompt,
                                tools.template_tools)
    prompt_ids = server.encode(prompt)
    max_tokens = body.requested_max_tokens
    if max_tokens is None:  # the rest of the context (at least one token: a full prompt then fails the length check)
        max_tokens = max(server.engine.max_model_len - len(prompt_ids), 1)
    try:
        params = body.sampling_params(max_tokens, body.num_logprobs, tools.constraint())
        response_id, requests = server.new_requests("chatcmpl", body.n)
        requests.submit([prompt_ids], params)
    except (ValueError, TypeError) as error:
        raise bad_request(error) from error
    created = int(time.time())

    def fields(delta: ChoiceDelta) -> dict:
        return {"index": delta.index, "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
                "logprobs": None if delta.logprobs is None else chat_logprobs(server, delta.logprobs),
                "token_ids": delta.token_ids if body.return_token_ids else None}

    if body.stream:
        def chunk(choices: list[ChatChunkChoice], counts: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=response_id, created=created, model=server.model_name, choices=choices,
                                       usage=counts)

        first = [chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                 for i in range(body.n)]
        usage_chunk = (lambda counts: chunk([], counts)) if body.include_usage else None
        deltas = ReplyDeltas(tools, prompt, server.tokenizer, requests.choices.whole)

        def delta_chunk(d: ChoiceDelta) -> ChatCompletionChunk | None:
            message = deltas.message(d)
            if message is None:
                return None
            return chunk([ChatChunkChoice(delta=message, **{**fields(deltas.covered(d)),
                                                            "finish_reason": deltas.finish_reason(d)})])

        return sse_response(stream_choices(requests, delta_chunk, usage_chunk, first))
    whole = await unless_disconnected(request, requests.complete())
    choices = []
    for d in whole:
        content, calls = tools.parse(d.text, prompt, server.tokenizer)
        message = AssistantMessage(content=content, tool_calls=[ToolCallEntry(
            id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments)) for call in calls])
        choices.append(ChatChoice(message=message, **{**fields(d), "finish_reason": reply_finish(tools, d, calls)}))
    return ChatCompletionResponse(id=response_id, created=created, model=server.model_name, choices=choices,
                                  usage=requests.choices.usage())


def chat_logprobs(server: ServerState, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and top alternatives."""
    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = server.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[TokenLogprobEntry(**entry(lp.token_id, lp.logprob).model_dump(),
                                                   top_logprobs=[entry(t, v) for t, v in lp.top])
                                 for lp in logprobs])
