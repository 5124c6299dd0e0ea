"""Tool calling in chat completions (OpenAI's `tools` / `tool_choice`, vLLM's rules):

- the tools are rendered into the prompt by the tokenizer's chat template (`apply_chat_template(tools=...)`);
- `tool_choice` "none": the model replies in text, nothing is parsed;
- a named function (`{"type": "function", "function": {"name": ...}}`): the reply is constrained to that function's
  `parameters` JSON schema and is returned as its one call's `arguments` (finish_reason "stop", as OpenAI does);
- "required": the reply is constrained to a JSON array of at least one `{"name", "parameters"}` object, each naming a
  tool and fitting its schema; every element becomes a call, its arguments the text written (finish_reason
  "tool_calls");
- "auto" (the default with tools): the reply is free; transformers' reply parser (`tokenizer.parse_response`, driven
  by the tokenizer's `response_template`) finds the calls in it. A tokenizer without a `response_template` cannot
  say where a call is, so "auto" is a 400 for it (use "required" or a named function). Where the template marks a
  call as JSON between an opening and a closing string (`tool_calls: {"open", "close", "content": "json"}`, its
  transform naming the keys of the function's name and arguments), the reply is constrained by a structural tag
  (vLLM's strict tool calling): text stays free, but once the model writes the opening string the call must name
  one of the tools, its arguments must fit that tool's `parameters`, and it must close. A reply whose calls do not
  parse (cut short by `max_tokens`) is returned as text.

Arguments are returned as JSON text, as OpenAI's API does; each call gets an id `call_<24 hex digits>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from ..structured.constraint import StructuredOutput
from .request_model import RequestModel
from .tool_stream import CallFormat, RequiredCallStream, ToolCall

ToolMode = Literal["none", "auto", "required", "named"]


class FunctionDefinition(RequestModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (no `parameters`: an object with no members)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(RequestModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools: what the template renders, what constrains the reply, how it is read."""

    mode: ToolMode
    tools: list[Tool]
    name: str | None = None  # the function a named choice forces
    call_format: CallFormat | None = None  # how "auto" replies write calls, where the template says

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as `apply_chat_template(tools=...)` takes them (None without tools)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] or None

    def constraint(self) -> StructuredOutput | None:
        """The reply's constraint: the named function's arguments, a non-empty array of calls (required), or free
        text whose calls fit their tools (auto, where the template's call format is known)."""
        if self.mode == "named":
            return StructuredOutput(json=self._function(self.name).schema)
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                                       "parameters": tool.function.schema},
                      "required": ["name", "parameters"], "additionalProperties": False} for tool in self.tools]
            return StructuredOutput(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
        if self.mode == "auto" and self.call_format is not None:
            return StructuredOutput(structural_tag=self.call_format.structural_tag(
                {tool.function.name: tool.function.schema for tool in self.tools}))
        return None

    def parse(self, text: str, prompt: str, tokenizer: PreTrainedTokenizerBase) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished reply; calls that do not parse leave the whole reply as content."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":  # the arguments as written (as streamed)
            stream = RequiredCallStream([tool.function.name for tool in self.tools])
            stream.feed(text, finished=True)
            whole = stream.finished_calls == len(stream.calls) > 0 and text.rstrip().endswith("]")
            return (None, stream.finished()) if whole else (text, [])  # else cut short by max_tokens
        if self.mode == "auto":
            return _parse_auto(text, prompt, tokenizer, self.template_tools)
        return text, []

    def _function(self, name: str) -> FunctionDefinition:
        return next(tool.function for tool in self.tools if tool.function.name == name)


def plan_tools(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None,
               tokenizer: PreTrainedTokenizerBase) -> ToolPlan:
    """The request's `ToolPlan`; ValueError naming `tools` / `tool_choice` for a choice that cannot be honoured."""
    tools = tools or []
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"`tools` must have distinct function names, got {names}")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ValueError(f"`tool_choice` names the function {choice.function.name!r}, which is not in `tools` "
                             f"({', '.join(names) or 'none given'})")
        return ToolPlan("named", tools, choice.function.name)
    if choice not in ("none", "auto", "required"):
        raise ValueError(f'`tool_choice` must be "none", "auto", "required" or a named function, got {choice!r}')
    if choice == "required" and not tools:
        raise ValueError('`tool_choice` "required" needs `tools`')
    if choice == "auto" and tools and getattr(tokenizer, "response_template", None) is None:
        raise ValueError('`tool_choice` "auto" needs the tokenizer\'s `response_template` (transformers\' reply '
                         'parser) to find calls in a free reply, and this model\'s tokenizer has none; use '
                         '"required" or a named function, whose replies are constrained to calls')
    return ToolPlan(choice if tools else "none", tools,
                    call_format=call_format(tokenizer) if choice == "auto" and tools else None)


def call_format(tokenizer: PreTrainedTokenizerBase) -> CallFormat | None:
    """The `CallFormat` the tokenizer's `response_template` describes: its `tool_calls` field parsed as JSON between
    `open` and `close`, transformed into a function whose `name` and `arguments` are plain keys of that JSON
    (`"{content.KEY}"`); None for any other template (its calls are parsed, not constrained)."""
    template = getattr(tokenizer, "response_template", None)
    field = (template or {}).get("fields", {}).get("tool_calls") if isinstance(template, dict) else None
    if not isinstance(field, dict) or field.get("content") != "json":
        return None
    opening, closing = field.get("open"), field.get("close")
    function = (field.get("transform") or {}).get("function") or {}
    keys = [re.fullmatch(r"\{content\.(\w+)\}", value) if isinstance(value, str) else None
            for value in (function.get("name"), function.get("arguments"))]
    if not (isinstance(opening, str) and opening and isinstance(closing, str) and closing and all(keys)):
        return None
    return CallFormat(opening, closing, keys[0].group(1), keys[1].group(1))


def _parse_auto(text: str, prompt: str, tokenizer: PreTrainedTokenizerBase,
                tools: list[dict[str, Any]] | None) -> tuple[str | None, list[ToolCall]]:
    try:
        message = tokenizer.parse_response(text, prefix=prompt, tools=tools)
    except (ValueError, KeyError, TypeError):  # a call that is not JSON: the reply stays text
        return text, []
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return text, []
        arguments = function.get("arguments", {})
        calls.append(ToolCall(function["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    content = message.get("content")
    return (content if content else None) if calls else text, calls
