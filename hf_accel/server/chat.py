"""`POST /v1/chat/completions`: the messages through the tokenizer's chat template, then the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ..engine.outputs import TokenLogprob
from .errors import bad_request
from .generation import ChoiceDelta, EngineRequests, unless_disconnected
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
from .tool_calls import ToolPlan
from .tool_replies import ReplyDeltas, reply_finish

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 server: ServerState = Depends(server_state)
                                 ) -> ChatCompletionResponse | StreamingResponse:
    """A reply per sample; with `stream`, a role chunk per choice, then content (or tool call) chunks of one choice
    each."""
    reply = ChatReply.submit(server, body)
    if body.stream:
        return reply.stream()
    return reply.whole(await unless_disconnected(request, reply.requests.complete()))


@dataclass(slots=True)
class ChatReply:
    """One chat request in the engine: its prompt (tools rendered), how it uses its tools, and its engine requests."""

    server: ServerState
    body: ChatCompletionRequest
    tools: ToolPlan
    prompt: str
    response_id: str
    requests: EngineRequests
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def submit(cls, server: ServerState, body: ChatCompletionRequest) -> ChatReply:
        """Render the prompt and queue its samples; 400 for what the request's fields cannot do, 404 for a `model`
        not served."""
        server.model_adapter(body.model)  # before the template: an unknown model is the first thing to say
        try:
            tools = body.tool_plan(server.tokenizer)
        except ValueError as error:
            raise bad_request(error) from error
        prompt = server.chat_prompt([m.template_dict() for m in body.messages], body.add_generation_prompt,
                                    tools.template_tools)
        prompt_ids = server.encode(prompt)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # the rest of the context (at least one token: a full prompt fails the length check)
            max_tokens = max(server.engine.max_model_len - len(prompt_ids), 1)
        try:
            params = body.sampling_params(max_tokens, body.num_logprobs, tools.constraint())
            response_id, requests = server.new_requests("chatcmpl", body.n, body.model)
            requests.submit([prompt_ids], params)
        except (ValueError, TypeError) as error:
            raise bad_request(error) from error
        return cls(server, body, tools, prompt, response_id, requests)

    @property
    def model(self) -> str:
        """The name the responses carry: the requested model (an adapter's name, or the base's)."""
        return self.server.served_model(self.body.model)

    def fields(self, delta: ChoiceDelta, finish_reason: str | None) -> dict:
        return {"index": delta.index, "finish_reason": finish_reason, "stop_reason": delta.stop_reason,
                "logprobs": None if delta.logprobs is None else chat_logprobs(self.server, delta.logprobs),
                "token_ids": delta.token_ids if self.body.return_token_ids else None}

    def chunk(self, choices: list[ChatChunkChoice], counts: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                   usage=counts)

    def stream(self) -> StreamingResponse:
        first = [self.chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                 for i in range(self.body.n)]
        usage_chunk = (lambda counts: self.chunk([], counts)) if self.body.include_usage else None
        deltas = ReplyDeltas(self.tools, self.prompt, self.server.tokenizer, self.requests.choices.whole)

        def delta_chunk(d: ChoiceDelta) -> ChatCompletionChunk | None:
            message = deltas.message(d)
            if message is None:
                return None
            return self.chunk([ChatChunkChoice(delta=message,
                                               **self.fields(deltas.covered(d), deltas.finish_reason(d)))])

        return sse_response(stream_choices(self.requests, delta_chunk, usage_chunk, first), self.requests)

    def whole(self, choices: list[ChoiceDelta]) -> ChatCompletionResponse:
        replies = []
        for d in choices:
            content, calls = self.tools.parse(d.text, self.prompt, self.server.tokenizer)
            message = AssistantMessage(content=content, tool_calls=[ToolCallEntry(
                id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments)) for call in calls])
            replies.append(ChatChoice(message=message, **self.fields(d, reply_finish(self.tools, d, calls))))
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=replies,
                                      usage=self.requests.choices.usage())


def chat_logprobs(server: ServerState, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and top alternatives."""
    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = server.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[TokenLogprobEntry(**entry(lp.token_id, lp.logprob).model_dump(),
                                                   top_logprobs=[entry(t, v) for t, v in lp.top])
                                 for lp in logprobs])
