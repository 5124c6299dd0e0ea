"""Streamed "auto" replies whose calls are constrained (`tool_calls.CallFormat`): content and calls as they are
generated, in OpenAI's delta shape.

The structural tag makes every call read exactly `open` + `{"NAME_KEY": "<tool>", "ARGUMENTS_KEY": ` + the
arguments (one JSON value) + `}` + `close`, so the reply can be cut as it grows:
- text before a call goes out as content, except a tail that may be the start of `open` (held until it is not);
- once a call's opening part is whole, a delta with the call's id, type and name goes out (empty arguments);
- the arguments go out as they come, up to where their JSON value ends (strings and nesting followed);
- `}` + `close` ends the call; text after it is content again.
A reply cut short (`max_tokens`) leaves its last call's arguments unfinished, as vLLM streams them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .responses import DeltaFunction, DeltaMessage, DeltaToolCall
from .tool_calls import CallFormat, ToolCall


@dataclass
class AutoCallStream:
    """The stream of one choice: `feed` it the choice's whole text after each delta."""

    format: CallFormat
    names: list[str]
    calls: list[ToolCall] = field(default_factory=list)  # the calls begun, in order
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
        for name in self.names:
            begin = self._begin(name)
            if text.startswith(begin, at):
                call = ToolCall(name, "")
                self.calls.append(call)
                pieces.append(DeltaToolCall(index=len(self.calls) - 1, id=call.id, type="function",
                                            function=DeltaFunction(name=name, arguments="")))
                self._sent = self._arguments_at = at + len(begin)
                return True
        if finished:  # an opening cut short: it goes out as content
            content.append(text[at:])
            self._sent = len(text)
            return False
        if any(self._begin(name).startswith(text[at:]) for name in self.names):
            return False  # may still become a call's opening
        content.append(opening)  # not a call's opening after all: content, and the text after it is read on
        self._sent = at + len(opening)
        return True

    def _arguments(self, text: str, finished: bool, pieces: list[DeltaToolCall]) -> bool:
        """The open call's arguments as they come; True once the call closed (text after it may follow)."""
        end = _json_end(text, self._arguments_at)
        stop = len(text) if end is None else end
        if stop > self._sent:
            pieces.append(DeltaToolCall(index=len(self.calls) - 1,
                                        function=DeltaFunction(arguments=text[self._sent: stop])))
            self._sent = stop
        closing = "}" + self.format.close
        if end is None or not text.startswith(closing, end):
            return False
        self._sent, self._arguments_at = end + len(closing), None
        self.finished_calls += 1
        return True

    def _begin(self, name: str) -> str:
        return (f"{self.format.open}{{{json.dumps(self.format.name_key)}: {json.dumps(name)}, "
                f"{json.dumps(self.format.arguments_key)}: ")


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
