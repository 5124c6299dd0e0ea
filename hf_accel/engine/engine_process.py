"""`EngineProcess`: an `Engine` stepping in a process of its own (vLLM's engine-core process), driven from this one.

Why: the model step and the serving work (HTTP, SSE, JSON, the event loop) are both Python, and in one process they
share one interpreter lock. The compiled step gives the lock up at every kernel, and a thread that wants it back
waits for whichever thread holds it (up to the switch interval, 5 ms), so a busy server thread stretches every step
(measured in docs/serving.md, "The engine-core process"). In its own process the engine core steps undisturbed
while this process does the rest on the other core, so step N + 1 is scheduled and computed while this process
streams step N's tokens.

How:
- the child (`core_process.py`) builds its `Engine` with `factory` (a picklable callable, e.g. a
  `functools.partial` of a module-level function: the child is spawned, so it loads the model itself, configured as
  the factory says), sends its limits, then loops: take the commands
  waiting on the pipe (block only when idle), run one step, send that step's reports, the whole output of every
  request that finished, and the engine's stats, in one message;
- this process checks each request against the child's limits (`Admission`) before sending it, so bad input raises
  here, in the caller's thread, as with `Engine`; one reader thread hands the reports to the listeners;
- death: a fault the child's engine cannot survive, or the child exiting, marks this side dead (`is_healthy`,
  `dead_reason`) and every open request's listener gets the error, as with `Engine`.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from ..lora.adapter_check import AdapterCheck
from ..lora.config import LoRARequest, check_lora_id
from .admission import Admission
from .core_process import Ready, StepReport, run_engine_core
from .engine import Engine
from .engine_client import EngineClient
from .engine_stats import EngineStats
from .errors import EngineDeadError, describe
from .listeners import Listener, Listeners
from .sequence import Request

logger = logging.getLogger(__name__)
DEFAULT_STARTUP_TIMEOUT = 900.0  # seconds: loading, a kernel build and a cold compile of a large model


class EngineProcessError(RuntimeError):
    """The engine-core process failed: its message is what the child reported (`"<type>: <message>"`)."""


class EngineProcess(EngineClient):
    """An `Engine` built by `factory()` in a spawned process, with `Engine`'s request API (`add_request`, `abort`,
    `stream`, `generate`, `stats`, `add_finish_observer`, `is_healthy`, `shutdown`), which the server uses.

    Args:
        factory: builds the engine in the child; picklable (a module-level function, or a `functools.partial` of
            one with picklable arguments).
        tokenizer: the engine's tokenizer, loaded in this process too: string prompts are encoded here.
        startup_timeout: seconds to wait for the child's engine (RuntimeError after, or when the child fails).

    The child is spawned (never forked: torch's threads do not survive a fork), so a script that makes one must do it
    under `if __name__ == "__main__":`, as with any spawned process; notebooks need nothing.
    """

    def __init__(self, factory: Callable[[], Engine], tokenizer: PreTrainedTokenizerBase | None = None, *,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT):
        context = multiprocessing.get_context("spawn")  # never fork a process that holds torch's threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_core, args=(child_conn, factory),
                                        name="hf_accel-engine-core", daemon=True)
        self._process.start()
        child_conn.close()
        try:
            ready = self._wait_ready(startup_timeout)
        except BaseException:
            self._conn.close()
            raise
        self.tokenizer, self.config, self.limits = tokenizer, ready.config, ready.limits
        # adapters are checked here too, so a bad folder raises in the caller's thread; the child reads its own copy
        self._adapters = None if ready.adapters is None else AdapterCheck(ready.adapters)
        self._admission = Admission(tokenizer, ready.limits, self._adapters)
        self._stats = ready.stats
        self._listeners = Listeners()  # registered under `_lock`, delivered to in the reader thread
        self._lock = threading.Lock()  # orders registrations against shutdown and death
        self._dead: BaseException | None = None
        self._closing = False
        # callers never write to the pipe themselves: a full pipe would block them (and the reader, when it aborts)
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="hf_accel-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="hf_accel-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    @property
    def pid(self) -> int | None:
        """The engine-core process's id."""
        return self._process.pid

    @property
    def is_running(self) -> bool:
        return self._process.is_alive() and self._dead is None and not self._closing

    @property
    def dead_reason(self) -> str | None:
        """What stopped the engine (`"<error type>: <message>"`), or None while it is healthy."""
        return None if self._dead is None else str(self._dead)

    def start(self) -> None:
        """No-op (the engine-core process steps from the start); raises EngineDeadError once it has died."""
        self._check_alive()

    def submit(self, request: Request, listener: Listener | None = None) -> None:
        """As `Engine.submit` (thread-safe); the listener is called in this process's reader thread."""
        with self._lock:  # after shutdown or death nothing is registered: whoever is registered hears the end
            self._check_alive()
            self._register(request, listener)
            self._outbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        """Stop a request at the child's next step, freeing its blocks (unknown ids ignored)."""
        if self._dead is None and not self._closing:
            self._outbox.put(("abort", request_id))

    def add_lora(self, lora_request: LoRARequest) -> None:
        """As `EngineClient.add_lora`; the engine-core process then reads the adapter into its memory."""
        super().add_lora(lora_request)
        self._outbox.put(("add_lora", lora_request))

    def remove_lora(self, lora_int_id: int) -> None:
        """As `EngineClient.remove_lora`, at the engine-core process's next step."""
        check_lora_id(lora_int_id, self._adapters)
        self._adapters.remove(lora_int_id)
        if self._dead is None and not self._closing:
            self._outbox.put(("remove_lora", lora_int_id))

    def _run_until(self, done: threading.Event) -> None:
        done.wait()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step."""
        return self._stats

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the child after its current step (unfinished requests are aborted and reported), then wait for it;
        killed if it does not exit within `timeout` seconds. Requests it never reported on get an error."""
        with self._lock:
            closing, self._closing = self._closing, True
        if not closing and self._dead is None:
            self._outbox.put(("shutdown",))
        self._outbox.put(None)  # the writer stops after what is queued
        self._writer.join(timeout)
        self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._listeners.fail_all(EngineProcessError("the engine-core process was shut down"))
        self._conn.close()

    def _wait_ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                break
            if time.monotonic() > deadline:
                self._process.kill()
                self._process.join()
                raise RuntimeError(f"the engine-core process did not build its engine within {timeout:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:  # it died before a word (out of memory, a crash)
            self._process.join()
            raise RuntimeError(f"the engine-core process exited with code {self._process.exitcode} while building "
                               "its engine (its log is above)") from None
        if kind == "failed":
            self._process.join(10)
            raise EngineProcessError(f"building the engine in its process failed: {payload}")
        return payload

    def _write(self) -> None:
        """The writer thread: send what callers queue, in order, until told to stop or the pipe breaks (then the
        reader reports the child gone)."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return

    def _read(self) -> None:
        """The reader thread: hand each step's reports to their listeners until the child closes or dies."""
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "step":
                    self._deliver(payload)
                elif kind == "dead":
                    self._die(EngineProcessError(payload))
                    return
                elif kind == "closed":
                    return
        except (EOFError, OSError):
            if not self._closing:
                self._process.join(5)  # reap it, for its exit code
                self._die(EngineProcessError(f"the engine-core process exited (code {self._process.exitcode})"))
        except BaseException as error:  # a report that cannot be read: nothing more can be trusted
            self._die(EngineProcessError(f"reading the engine-core process's reports failed: {describe(error)}"))

    def _deliver(self, step: StepReport) -> None:
        self._stats = step.stats  # before the reports: whoever sees a request finish sees its step's counters
        for report in step.reports:
            if not self._listeners.deliver(report) and not report.finished:
                self.abort(report.request_id)
        for whole in step.finished:
            self._listeners.observe_finished(whole)

    def _die(self, error: EngineProcessError) -> None:
        logger.error("the engine-core process stopped; every request fails from now on: %s", error)
        with self._lock:
            self._dead = error
        self._listeners.fail_all(error)  # nothing registers once `_dead` is set

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine-core process died; create a new EngineProcess") from self._dead
        if self._closing:
            raise EngineDeadError("the engine-core process was shut down")
