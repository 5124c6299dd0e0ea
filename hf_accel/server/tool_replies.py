"""Chat replies under a `ToolPlan` (`tool_calls.py`), whole and streamed.

Streamed: without tools, content deltas as they come; with a named function, the call's `arguments` text as it
comes (its first piece carries the call's id, type and name, OpenAI's delta shape); with "auto" where the template's
call format is known (its calls constrained) and with "required", content and calls as they come
(`tool_stream.py`); with "auto" of another template, a choice is held back until it finishes, then sent in one chunk
(its content, if any, and every call whole), because whether text is a call is only known once it is complete.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .generation import ChoiceDelta
from .responses import DeltaFunction, DeltaMessage, DeltaToolCall
from .tool_calls import ToolPlan
from .tool_stream import AutoCallStream, RequiredCallStream, ToolCall


def reply_finish(plan: ToolPlan, delta: ChoiceDelta, calls: list[ToolCall]) -> str | None:
    """The choice's finish_reason: "tool_calls" when an "auto" or "required" reply that stopped made calls (a
    named function's reply stops with "stop", as in OpenAI's API)."""
    if delta.finish_reason == "stop" and calls and plan.mode in ("auto", "required"):
        return "tool_calls"
    return delta.finish_reason


class ReplyDeltas:
    """The streamed messages of one request's choices (`whole`: each choice's text so far, by index)."""

    def __init__(self, plan: ToolPlan, prompt: str, tokenizer: PreTrainedTokenizerBase,
                 whole: dict[int, ChoiceDelta]):
        self.plan, self.prompt, self.tokenizer, self.whole = plan, prompt, tokenizer, whole
        self._named: dict[int, ToolCall] = {}  # choice index -> its call (named function)
        self._calls: dict[int, list[ToolCall]] = {}  # choice index -> its calls, once finished
        self._streams: dict[int, AutoCallStream] = {}  # choice index -> its stream (calls streamed as they come)
        # "auto" replies of a template whose calls are not constrained: whole at the end
        self.held = plan.mode == "auto" and plan.call_format is None

    def message(self, delta: ChoiceDelta) -> DeltaMessage | None:
        """The chunk's message for `delta`; None while a held-back "auto" choice is not finished."""
        if self.plan.mode == "none":
            return DeltaMessage(content=delta.text)
        if self.plan.mode == "named":
            return DeltaMessage(tool_calls=[self._named_piece(delta)])
        if not self.held:  # "required", or "auto" with constrained calls
            return self._stream_piece(delta)
        if delta.finish_reason is None:
            return None
        content, calls = self.plan.parse(self.whole[delta.index].text, self.prompt, self.tokenizer)
        self._calls[delta.index] = calls
        pieces = [DeltaToolCall(index=i, id=call.id, type="function",
                                function=DeltaFunction(name=call.name, arguments=call.arguments))
                  for i, call in enumerate(calls)]
        return DeltaMessage(content=content, tool_calls=pieces or None)

    def covered(self, delta: ChoiceDelta) -> ChoiceDelta:
        """What the chunk of `delta` stands for: the whole choice for a held-back one (its token ids and logprobs
        go out in that one chunk), else `delta` itself."""
        return self.whole[delta.index] if self.held else delta

    def finish_reason(self, delta: ChoiceDelta) -> str | None:
        return reply_finish(self.plan, delta, self._calls.get(delta.index, []))

    def _stream_piece(self, delta: ChoiceDelta) -> DeltaMessage:
        stream = self._streams.get(delta.index)
        if stream is None:
            names = [tool.function.name for tool in self.plan.tools]
            stream = self._streams[delta.index] = RequiredCallStream(names) if self.plan.mode == "required" else \
                AutoCallStream(self.plan.call_format, names)
        message = stream.feed(self.whole[delta.index].text, delta.finish_reason is not None)
        self._calls[delta.index] = stream.finished()
        return message

    def _named_piece(self, delta: ChoiceDelta) -> DeltaToolCall:
        if delta.index in self._named:
            return DeltaToolCall(index=0, function=DeltaFunction(arguments=delta.text))
        call = self._named[delta.index] = ToolCall(self.plan.name, "")
        return DeltaToolCall(index=0, id=call.id, type="function",
                             function=DeltaFunction(name=call.name, arguments=delta.text))
