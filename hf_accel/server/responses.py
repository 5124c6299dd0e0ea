"""Response bodies of the HTTP API, in OpenAI's shapes (plus vLLM's `stop_reason` and `token_ids`); streamed chunks
use the same models with one choice each. Fields that do not apply are null, as in OpenAI's responses."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives and character offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChoiceFields(BaseModel):
    """What every choice (completion, chat, chat chunk) carries besides its text and logprobs."""

    index: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended the choice
    token_ids: list[int] | None = None  # with `return_token_ids`: the choice's (new) token ids


class CompletionChoice(ChoiceFields):
    text: str
    logprobs: CompletionLogprobs | None = None


class ResponseFields(BaseModel):
    """What every completion response and chunk carries (`usage`: in a stream, only its last chunk's)."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionResponse(ResponseFields):
    """A completion, or one streamed chunk of it (one choice; or no choice and the usage)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallEntry(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallEntry] = Field(default_factory=list)


class ChatChoice(ChoiceFields):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(ResponseFields):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of call `index`: its first piece has the id, type and name; `arguments` text follows in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ChoiceFields):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(ResponseFields):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hf_accel"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """vLLM's /tokenize answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
