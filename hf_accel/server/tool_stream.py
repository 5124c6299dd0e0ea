"""Streamed replies whose calls are constrained: "auto" of a known call format (`tool_calls.CallFormat`) and
"required" (`RequiredCallStream`), content and calls as they are generated, in OpenAI's delta shape.

The structural tag makes every call read exactly `open` + `{"NAME_KEY": "<tool>", "ARGUMENTS_KEY": ` + the
arguments (one JSON value) + `}` + `close`, so the reply can be cut as it grows:
- text before a call goes out as content, except a tail that may be the start of `open` (held until it is not);
- once a call's opening part is whole, a delta with the call's id, type and name goes out (empty arguments);
- the arguments go out as they come, up to where their JSON value ends (strings and nesting followed);
- `}` + `close` ends the call; text after it is content again.
A reply cut short (`max_tokens`) leaves its last call's arguments unfinished, as vLLM streams them. A "required"
reply is a JSON array of `{"name": ..., "parameters": ...}` objects, read the same way, its punctuation dropped.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from .responses import DeltaFunction, DeltaMessage, DeltaToolCall


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How the chat template writes a call: `open` + a JSON object whose `name_key` is the function's name and
    `arguments_key` its arguments (the name first, as the template's `tojson` writes them) + `close`."""

    open: str
    close: str
    name_key: str
    arguments_key: str

    def begin(self, name: str) -> str:
        """What a call of function `name` starts with, up to its arguments."""
        return f"{self.open}{{{json.dumps(self.name_key)}: {json.dumps(name)}, {json.dumps(self.arguments_key)}: "

    def structural_tag(self, schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """xgrammar's structural tag: free text in which `open` starts a call of one of the functions (name ->
        its arguments' JSON schema), fitting its schema."""
        tags = [{"begin": self.begin(name), "content": {"type": "json_schema", "json_schema": schema},
                 "end": f"}}{self.close}"} for name, schema in schemas.items()]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.open],
                                                     "tags": tags, "at_least_one": False, "stop_after_first": False}}


@dataclass
class AutoCallStream:
    """The stream of one choice: `feed` it the choice's whole text after each delta."""

    format: CallFormat
    names: list[str]
    calls: list[ToolCall] = field(default_factory=list)  # the calls begun, in order (arguments left empty)
    arguments: list[str] = field(default_factory=list)  # each begun call's arguments so far
    finished_calls: int = 0
    _sent: int = 0  # text before this has gone out (as content, a call's opening or its arguments)
    _arguments_at: int | None = None  # where the open call's arguments start, while one is open

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        """What of `text` (the choice so far) has not gone out and can: content and call pieces."""
        content, pieces = [], []
        while True:
            if self._arguments_at is None:
                if not self._text(text, finished, content, pieces):
                    break
            elif not self._arguments(text, finished, pieces):
                break
        return DeltaMessage(content="".join(content) if content else ("" if not pieces else None),
                            tool_calls=pieces or None)

    def _text(self, text: str, finished: bool, content: list[str], pieces: list[DeltaToolCall]) -> bool:
        """Content up to the next call (or up to a tail that may open one); True when a call's opening went out."""
        opening = self.format.open
        at = text.find(opening, self._sent)
        if at < 0:
            end = len(text) if finished else len(text) - _open_prefix(text, opening)
            content.append(text[self._sent: end])
            self._sent = end
            return False
        content.append(text[self._sent: at])
        self._sent = at
        if self._start_call(text, at, pieces):
            return True
        if finished:  # an opening cut short: it goes out as content
            content.append(text[at:])
            self._sent = len(text)
            return False
        if any(self.format.begin(name).startswith(text[at:]) for name in self.names):
            return False  # may still become a call's opening
        content.append(opening)  # not a call's opening after all: content, and the text after it is read on
        self._sent = at + len(opening)
        return True

    def _start_call(self, text: str, at: int, pieces: list[DeltaToolCall]) -> bool:
        """Whether a call's whole opening starts at `at`; if so it goes out (id, type, name)."""
        for name in self.names:
            begin = self.format.begin(name)
            if text.startswith(begin, at):
                call = ToolCall(name, "")
                self.calls.append(call)
                self.arguments.append("")
                pieces.append(DeltaToolCall(index=len(self.calls) - 1, id=call.id, type="function",
                                            function=DeltaFunction(name=name, arguments="")))
                self._sent = self._arguments_at = at + len(begin)
                return True
        return False

    def finished(self) -> list[ToolCall]:
        """The calls that closed, with their arguments' text."""
        return [ToolCall(call.name, arguments, call.id)
                for call, arguments in zip(self.calls[: self.finished_calls], self.arguments)]

    def _arguments(self, text: str, finished: bool, pieces: list[DeltaToolCall]) -> bool:
        """The open call's arguments as they come; True once the call closed (text after it may follow)."""
        end = _json_end(text, self._arguments_at)
        stop = len(text) if end is None else end
        if stop > self._sent:
            piece = text[self._sent: stop]
            self.arguments[-1] += piece
            pieces.append(DeltaToolCall(index=len(self.calls) - 1, function=DeltaFunction(arguments=piece)))
            self._sent = stop
        closing = "}" + self.format.close
        if end is None or not text.startswith(closing, end):
            return False
        self._sent, self._arguments_at = end + len(closing), None
        self.finished_calls += 1
        return True


class RequiredCallStream(AutoCallStream):
    """A "required" reply (`[{"name": ..., "parameters": ...}, ...]`): its calls as they come, no content."""

    def __init__(self, names: list[str]):
        super().__init__(CallFormat("", "", "name", "parameters"), names)

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        return DeltaMessage(tool_calls=super().feed(text, finished).tool_calls)

    def _text(self, text: str, finished: bool, content: list[str], pieces: list[DeltaToolCall]) -> bool:
        at = self._sent
        while at < len(text) and text[at] in "[, ]":  # the array's punctuation between calls
            at += 1
        self._sent = at
        return self._start_call(text, at, pieces)


def _open_prefix(text: str, opening: str) -> int:
    """The length of the longest tail of `text` that `opening` starts with (what may be a call's opening)."""
    for size in range(min(len(opening) - 1, len(text)), 0, -1):
        if opening.startswith(text[-size:]):
            return size
    return 0


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at `text[start]` (an object or array) ends, or None while it is open."""
    depth, quoted, escaped = 0, False, False
    for at in range(start, len(text)):
        char = text[at]
        if escaped:
            escaped = False
        elif quoted:
            escaped, quoted = char == "\\", char != '"'
        elif char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return at + 1
    return None
