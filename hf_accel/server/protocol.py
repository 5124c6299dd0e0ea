"""Request bodies of the HTTP API: OpenAI's fields plus vLLM's sampling extras, validated strictly (a string where
a number belongs is a 400, not a coercion; NaN and infinities are refused). An explicit `null` means "the
default". Sampling ranges are checked
once, by `SamplingParams`, whose errors name the field; only the server's own bounds live here (at most 20
logprobs, `max_completion_tokens` >= 1). Fields this server cannot honour (`presence_penalty`, `frequency_penalty`,
`logit_bias`, `echo`, `suffix`, `best_of` != `n`, vLLM's older `guided_*`) get a 400 when
set to anything but their no-op value, never a 200 that ignored them; other unknown fields are ignored.

Constrained output (`structured_fields.py`): OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and
vLLM's `structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`); a constraint the grammar backend
refuses is a 400 naming `structured_outputs`. Tool calls (`tools`, `tool_choice`): `tool_calls.py`.

Extras beyond OpenAI's fields (vLLM's names): `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `priority` (lower runs first), `return_token_ids` (choices carry their `token_ids`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from transformers import PreTrainedTokenizerBase

from ..engine.sampling_params import MAX_LOGPROBS, SamplingParams
from ..structured.constraint import StructuredOutput
from .request_model import RequestModel
from .structured_fields import ResponseFormat, StructuredOutputsField, request_constraint
from .tool_calls import NamedToolChoice, Tool, ToolPlan, plan_tools


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

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        constraint: StructuredOutput | None = None) -> SamplingParams:
        """The engine's parameters (`constraint`: one that replaces the request's own, a tool choice's); raises
        SamplingParams' ValueError / TypeError naming a field out of range."""
        if constraint is None:
            constraint = request_constraint(self.response_format, self.structured_outputs)
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed, n=self.n,
            logprobs=logprobs, priority=self.priority,
            structured_outputs=constraint,
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


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] = ""
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an earlier assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined into one string; calls with their arguments as
        a dict where they are JSON (transformers' convention), the answered call's id on a tool message."""
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`: the messages go through the tokenizer's chat template. Without `max_tokens`
    (or `max_completion_tokens`) the reply may fill the rest of the model's context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant turn's opening
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def tool_plan(self, tokenizer: PreTrainedTokenizerBase) -> ToolPlan:
        """How the reply uses `tools` (`tool_calls.py`); ValueError naming the field when it cannot be honoured."""
        plan = plan_tools(self.tools, self.tool_choice, tokenizer)
        if plan.mode in ("named", "required") and \
                request_constraint(self.response_format, self.structured_outputs) is not None:
            raise ValueError(f"`tool_choice` {plan.mode!r} constrains the reply to calls: it cannot be combined "
                             "with `response_format` or `structured_outputs`")
        return plan

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


class LoadLoRAAdapterRequest(RequestModel):
    """`POST /v1/load_lora_adapter` (vLLM's shape): serve the peft adapter folder `lora_path` as model `lora_name`;
    `load_inplace`: also when `lora_name` is served (from now on by this folder)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(RequestModel):
    """`POST /v1/unload_lora_adapter` (vLLM's shape): stop serving `lora_name`."""

    lora_name: str = Field(min_length=1)
