"""`ForcedSpelling`: how the model spells the text its grammar forces, learned from what it wrote there.

Where a grammar allows one continuation (a JSON key, `": "`, closing brackets), jump-forward drafts that text as
tokens, and verification keeps a token only where the model, masked by the grammar, would have chosen it. The text
is forced; its tokenization is not: the grammar allows every split of it into vocabulary tokens, and the model picks
its own. xgrammar's draft (`find_jump_forward_tokens`: the longest vocabulary tokens) was the model's own split for
38% of drafted tokens on bench_structured's extraction workload (1.1 tokens kept per round); the tokenizer's BPE
split, 39%. The split the model wrote the last time the grammar forced the same text: 83% (4.1 kept per round).
So a matcher that drafts forced text records, once the model has written past it, the tokens it wrote over it
(`TokenMatcher.forced_tokens`), and the next draft of that text, in any sequence that shares this object, is that
split. A record that is wrong again is only a draft: verification keeps outputs exact, and the record is replaced.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence

MAX_TEXTS = 4096  # forced texts remembered (least recently used out first)
MAX_SPELLED = 16  # tokens kept per text: a draft takes at most the first few (the engine 4 a step)


class ForcedSpelling:
    """Forced text -> the tokens the model last wrote it with, for one vocabulary (`token_bytes[i]`: token i's
    length in bytes, as the grammar counts text). Engines' threads and `generate` calls may share one: each read and
    write holds its lock."""

    def __init__(self, token_bytes: Sequence[int]):
        self.token_bytes = token_bytes
        self._texts: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def get(self, text: str) -> list[int] | None:
        """The tokens last recorded for `text` (a copy), or None."""
        with self._lock:
            tokens = self._texts.get(text)
            if tokens is None:
                return None
            self._texts.move_to_end(text)
            return list(tokens)

    def record(self, text: str, length: int, written: Sequence[int]) -> bool:
        """Record how `written` (the tokens after the place where `text`, `length` bytes, was forced) spells it:
        the tokens that end inside it (the first `MAX_SPELLED`), when they reach its end or a token crosses it; where
        the first token already crosses it, what was recorded for it goes. False while `written` is still short of
        its end (nothing recorded)."""
        total = 0
        for count, token in enumerate(written):
            total += self.token_bytes[token] if 0 <= token < len(self.token_bytes) else 0
            if total >= length:
                self._store(text, list(written[: min(count + 1 if total == length else count, MAX_SPELLED)]))
                return True
        return False

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()

    def swap(self, texts: OrderedDict[str, list[int]]) -> OrderedDict[str, list[int]]:
        """Replace what it knows by `texts` (text -> tokens, least recently used first); returns what it knew."""
        with self._lock:
            known, self._texts = self._texts, texts
            return known

    def _store(self, text: str, spelled: list[int]) -> None:
        with self._lock:
            if not spelled:  # the model merged the text's start with what followed: no draft of it fits
                self._texts.pop(text, None)
                return
            self._texts[text] = spelled
            self._texts.move_to_end(text)
            while len(self._texts) > MAX_TEXTS:
                self._texts.popitem(last=False)


_BY_COMPILER: dict[int, ForcedSpelling] = {}  # by id of a live compiler (xgrammar's compilers are not hashable)
_LOCK = threading.Lock()


def spelling_for(compiler: object, compiled: object) -> ForcedSpelling:
    """The `ForcedSpelling` of the vocabulary `compiler` (an xgrammar `GrammarCompiler`) compiles against (read from
    `compiled`, a grammar it compiled), one per compiler: every grammar compiled by it (compilers are kept per
    tokenizer and vocabulary size, `grammars.compiler_for`), in every call, request and engine of the process,
    learns and drafts from the same spellings."""
    with _LOCK:
        found = _BY_COMPILER.get(id(compiler))
        if found is None:
            vocabulary = compiled.tokenizer_info.decoded_vocab
            found = _BY_COMPILER[id(compiler)] = ForcedSpelling([len(token) for token in vocabulary])
            weakref.finalize(compiler, _BY_COMPILER.pop, id(compiler), None)
        return found


def forget_spellings() -> None:
    """Forget every spelling learned so far, in every store (what a new process knows): benchmarks measure the
    first sight of a schema with it, tests start from it."""
    with _LOCK:
        for spelling in _BY_COMPILER.values():
            spelling.clear()


@contextlib.contextmanager
def spellings_forgotten() -> Iterator[None]:
    """Within it every store starts empty, as `forget_spellings` leaves them; on exit each knows again what it knew
    before (what was learned inside is dropped): a benchmark times a schema's first sight without the runs after it
    losing the spellings they were measured with."""
    with _LOCK:
        stores = list(_BY_COMPILER.values())
    known = [store.swap(OrderedDict()) for store in stores]
    try:
        yield
    finally:
        for store, texts in zip(stores, known):
            store.swap(texts)
