"""Request bodies of the HTTP API: OpenAI's fields plus vLLM's sampling extras, validated strictly (a string where
a number belongs is a 400, not a coercion; NaN and infinities are refused). An explicit `null` means "the
default". Sampling ranges are checked
once, by `SamplingParams`, whose errors name the field; only the server's own bounds live here (at most 20
logprobs, `max_completion_tokens` >= 1). Fields this server cannot honour (`presence_penalty`, `frequency_penalty`,
`logit_bias`, `echo`, `suffix`, `tools`, `tool_choice`, `best_of` != `n`, vLLM's older `guided_*`) get a 400 when
set to anything but their no-op value, never a 200 that ignored them; other unknown fields are ignored.

Constrained output (`structured_fields.py`): OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and
vLLM's `structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`); a constraint the grammar backend
refuses is a 400 naming `structured_outputs`.

Extras beyond OpenAI's fields (vLLM's names): `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `priority` (lower runs first), `return_token_ids` (choices carry their `token_ids`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..engine.sampling_params import MAX_LOGPROBS, SamplingParams
from .request_model import RequestModel
from .structured_fields import ResponseFormat, StructuredOutputsField, request_constraint


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    stop: str | list[str] = Field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's
    guided_json: Any = None  # vLLM's older names for structured_outputs' fields
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    @classmethod
    def _use_structured_outputs(cls, value: object) -> object:
        if value:
            raise ValueError("not supported by this server: use `structured_outputs` (vLLM's current name)")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("not supported by this server (only 0); use `repetition_penalty`")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("not supported by this server")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises SamplingParams' ValueError / TypeError naming a field out of range."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed, n=self.n,
            logprobs=logprobs, priority=self.priority,
            structured_outputs=request_constraint(self.response_format, self.structured_outputs),
        )


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`. `prompt`: a string, a list of strings, token ids, or a list of token-id lists (one
    engine request per prompt; choice `i * n + j` is sample `j` of prompt `i`)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("must not be empty")
        return value

    @field_validator("echo", "suffix")
    @classmethod
    def _not_supported(cls, value: object) -> object:
        if value:
            raise ValueError("not supported by this server")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] = ""
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates read it: text parts joined into one string."""
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`: the messages go through the tokenizer's chat template. Without `max_tokens`
    (or `max_completion_tokens`) the reply may fill the rest of the model's context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant turn's opening
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calls are not supported by this server")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: str | dict | None) -> str | dict | None:
        if value not in (None, "none", "auto"):  # without tools, "none" and "auto" ask for nothing
            raise ValueError('only "none" or "auto": tool calls are not supported by this server')
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token for the engine: None without `logprobs`, else `top_logprobs` (0 by default)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(RequestModel):
    """`POST /tokenize` (vLLM's shape): `prompt` text, or chat `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = False  # False: the ids the completions endpoint computes on
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` and `messages` must be given")
        return self


class DetokenizeRequest(RequestModel):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]
