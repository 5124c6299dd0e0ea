"""Requests with `SamplingParams(structured_outputs=...)`: their constraint checked when they are added, their grammar
compiled off the step loop.

- Admission (the caller's thread): the constraint is parsed (xgrammar `Grammar`: no vocabulary, cheap), so a bad
  schema, regex or grammar is a ValueError naming `structured_outputs` before anything reaches the engine; the
  engine must have a tokenizer (the grammar is compiled against its vocabulary).
- The engine core hands each such request to `GrammarCompiles`: one worker thread compiles its grammar against the
  model's vocabulary, on one core (xgrammar's default of 8 threads took the decoding step's cores: steps ran 2x
  slower during a compile on 2 cores); grammars compiled before (`MAX_COMPILED`, by constraint) start at once.
  The request waits, unscheduled and holding no blocks, until its grammar is ready; the other requests keep
  decoding. A compile that fails fails that request alone.
- Once ready, each of the request's samples gets its own `TokenMatcher`; the sampler masks its logits at every
  step (and at every candidate when speculating), and the committer advances it over each committed token.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections import OrderedDict
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..structured.constraint import StructuredOutput
from .sequence import Request

MAX_COMPILED = 64  # compiled grammars kept by constraint, for requests that need no wait
COMPILE_THREADS = 1  # xgrammar threads per compile: the step's threads keep their cores (bench_structured)
COMPILE_NICENESS = 10  # the compile thread's nice value (Linux): the step's thread runs first when they contend


def check_structured_outputs(tokenizer: PreTrainedTokenizerBase | None,
                             constraint: StructuredOutput) -> tuple[str, str]:
    """`constraint`'s key (`StructuredOutput.key`: what its grammar is compiled and kept under), once the backend
    parsed it; ValueError naming `structured_outputs` when the engine has no tokenizer or the backend refuses the
    constraint (ImportError naming the extra when xgrammar is missing). The parsed grammar is remembered by key
    (`grammars.parsed`): a server sending one schema many times parses it once, and the compile worker takes it from
    there."""
    if tokenizer is None:
        raise ValueError("`structured_outputs` needs the engine's tokenizer: create the Engine with `tokenizer=`")
    from ..structured.grammars import parsed

    key = constraint.key()
    try:
        parsed(key)
    except ValueError as error:
        raise ValueError(f"`structured_outputs`: {error}") from error
    return key


class GrammarCompiles:
    """Compiles constrained requests' grammars on one worker thread against one model's vocabulary (`vocab_size`
    logits, ending on `stop_token_ids`). Driven by the engine core's thread: `submit`, then `take_ready` each step."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[str, tuple[Request, concurrent.futures.Future]] = {}
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # by constraint key, least recent first
        self._spelling: Any = None  # the `ForcedSpelling` of its vocabulary, once a request asked

    def compiled(self, request: Request) -> Any | None:
        """`request`'s grammar if one with its constraint was compiled before (no wait, no worker), else None."""
        key = request.constraint_key
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
        return found

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def submit(self, request: Request) -> None:
        """Start compiling `request`'s grammar (it must have `structured_outputs`)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf_accel-grammar",
                                                                   initializer=_lower_priority)
        future = self._executor.submit(_compile, request.constraint_key, self._compiler())
        self._pending[request.request_id] = (request, future)

    def take_ready(self) -> list[tuple[Request, Any]]:
        """The requests whose compile ended since the last call, each with its compiled grammar, or with the
        exception the compile raised."""
        ready = []
        for request_id, (request, future) in list(self._pending.items()):
            if future.done():
                del self._pending[request_id]
                error = future.exception()
                if error is None:
                    self._remember(request.constraint_key, future.result())
                ready.append((request, future.result() if error is None else error))
        return ready

    def _remember(self, key: tuple[str, str], compiled: Any) -> None:
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    def wait(self, timeout: float) -> None:
        """Block until a pending compile ends or `timeout` seconds pass (for a step with nothing else to run)."""
        futures = [future for _, future in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def cancel(self, request: Request) -> None:
        """Forget `request`'s compile (aborted or failed while waiting); a compile already running ends unused."""
        entry = self._pending.pop(request.request_id, None)
        if entry is not None:
            entry[1].cancel()

    def shutdown(self) -> None:
        """Stop the worker after its current compile; pending requests are the caller's to abort first."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def spelling(self, request: Request, compiled: Any) -> Any:
        """The `ForcedSpelling` `request`'s sequences draft forced text with (`compiled`: its grammar), shared with
        every user of the tokenizer's compiler in the process; None unless the request is greedy with jump-forward
        (learned spellings change the drafts, and with them which draws a seeded sample takes)."""
        from ..structured.forced_spelling import spelling_for

        params = request.params
        if not params.structured_outputs.jump_forward or not params.is_greedy:
            return None
        if self._spelling is None:  # kept: a compiler evicted from grammars' cache is not rebuilt for it
            self._spelling = spelling_for(self._compiler(), compiled)
        return self._spelling

    def _compiler(self) -> Any:
        """The model vocabulary's grammar compiler, made here, on the engine's thread, the first time: reading the
        vocabulary uses the tokenizer, which the engine's detokenizer uses on this thread too (a fast tokenizer
        used from two threads at once can raise)."""
        from ..structured.grammars import compiler_for

        return compiler_for(self.tokenizer, self.vocab_size, self.stop_token_ids, COMPILE_THREADS)


def _compile(key: tuple[str, str], compiler: Any) -> Any:
    """On the worker: the grammar of the constraint under `key` compiled. Admission parsed it in this process, so
    what runs here is xgrammar's C++ alone, without the GIL: the stepping thread is never held up. (In an engine
    core process the parse happens here, once per constraint.)"""
    from ..structured.grammars import compile_parsed, parsed

    try:
        return compile_parsed(key[0], parsed(key), compiler)
    except ValueError as error:
        raise ValueError(f"`structured_outputs`: {error}") from error


def _lower_priority() -> None:
    """The compile thread yields to the stepping thread where the OS lets a thread be niced (Linux)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not on this OS, or not permitted: the default priority
        pass
