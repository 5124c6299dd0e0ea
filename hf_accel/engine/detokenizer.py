"""Incremental detokenization with stop strings, for streaming.

Each step decodes only the newest tokens plus the previous step's (the prefix/read offsets used by TGI and vLLM): text
is released once the window decodes without a dangling partial character, and text that could still be the start of
a stop string is held back until it cannot.

Each token decodes twice, so the decode call's own cost counts: for a fast tokenizer whose `decode` is transformers'
own and cleans up no spaces, the Rust backend's `decode` is called directly (`text_decoder`), the same text without
transformers' per-call conversions (a fifth of the detokenizer's host time at batch 8).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


@dataclass(slots=True)
class Detokenizer:
    """Text of one sample's output tokens, released as it becomes final."""

    tokenizer: PreTrainedTokenizerBase
    stop: list[str]
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (may end in held-back text)
    released: int = 0  # characters of `text` that are final
    prefix_offset: int = 0
    read_offset: int = 0
    decode: Callable[[list[int]], str] | None = field(default=None, repr=False)  # `text_decoder(tokenizer)` if None

    def __post_init__(self) -> None:
        if self.decode is None:
            self.decode = text_decoder(self.tokenizer)

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string it completed, if any (the text is then cut before it)."""
        self.tokens.append(token_id)
        window = self.tokens[self.prefix_offset:]
        prefix = self.decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self.decode(window)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop()

    def finish(self) -> None:
        """Release everything (the sample ended for another reason)."""
        rest = self.decode(self.tokens[self.prefix_offset:])
        done = self.decode(self.tokens[self.prefix_offset:self.read_offset])
        if len(rest) > len(done):
            self.text += rest[len(done):]
            self.read_offset = len(self.tokens)
        self.released = len(self.text)

    def _check_stop(self) -> str | None:
        # only text that could contain a stop string not yet seen: start a stop-length before the released mark
        start = max(self.released - max((len(s) for s in self.stop), default=0), 0)
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[:at]
            self.released = at
            return stop
        self.released = len(self.text) - _held_back(self.text, self.stop)
        return None


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function of `ids`: the Rust backend's own decode where
    transformers' would only call it (a fast tokenizer, `_decode` not overridden, no clean-up of spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string. Only prefixes ending in
    `text`'s last character can match, so each stop is searched backwards for that character (per token this costs
    the matches, not the stop's length)."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for stop in stops:
        size = min(len(stop) - 1, len(text))
        while size > longest:
            size = stop.rfind(last, 0, size) + 1  # the largest size <= this one whose prefix ends in `last`
            if size > longest and text.endswith(stop[:size]):
                longest = size
                break
            size -= 1
    return longest
