"""The engine-core process's side of `EngineProcess` (engine_process.py): build the engine, report ready, then loop:
take the commands waiting on the pipe (block only when idle), run one step, send that step's reports, the whole
output of every request that finished, and the engine's stats, in one message. Messages to it: `("add", Request)`,
`("abort", request_id)`, `("add_lora", LoRARequest)`, `("remove_lora", lora_int_id)`, `("shutdown",)`; from it:
`("ready", Ready)` or `("failed", reason)`, then `("step", StepReport)`, and last `("dead", reason)` or
`("closed", None)`."""

from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .config import EngineConfig
from .engine import Engine
from .engine_stats import EngineStats
from .errors import describe
from .limits import EngineLimits
from .outputs import RequestOutput
from ..lora.adapter_check import AdapterShapes
from ..lora.config import LoRARequest
from ..runtime.dynamo import skip_warm_guards

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ready:
    """What the child sends once its engine is built."""

    limits: EngineLimits
    config: EngineConfig
    stats: EngineStats
    adapters: AdapterShapes | None  # what a LoRA adapter must fit (None: the engine serves none)


@dataclass(slots=True)
class StepReport:
    """What the child sends after a step: the listeners' reports in order, the whole output of each request that
    finished (the same objects as its report unless it streams deltas: pickling keeps one copy), the stats."""

    reports: list[RequestOutput]
    finished: list[RequestOutput]
    stats: EngineStats


STATS_INTERVAL = 0.05  # seconds: the stats go out with every step that reports, else at most this often
COMPILE_POLL = 0.1  # seconds: how often an idle loop looks whether a background compile has ended (stats then)


def run_engine_core(conn: Connection, factory: Callable[[], Engine]) -> None:
    """The child's main: build the engine, report ready (or why not), then serve the pipe until told to stop or the
    other end closes. Ctrl-C in a terminal reaches the whole process group: the child ignores SIGINT, so the server's
    graceful shutdown decides when it stops (SIGTERM still ends it: that is how multiprocessing stops it at exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    skip_warm_guards(True)  # one thread steps compiled code in this process: dynamo's stance is the engine's alone
    try:
        engine = factory()
    except BaseException as error:
        traceback.print_exc()
        conn.send(("failed", describe(error)))
        return
    adapters = engine.core.adapters
    ready = Ready(engine.core.limits, engine.config, engine.stats(), None if adapters is None else adapters.shapes)
    conn.send(("ready", ready))
    try:
        _CoreLoop(conn, engine, ready.stats.compiling).run()
    except (BrokenPipeError, ConnectionResetError):  # the other side is gone: nobody to report to
        pass


class _CoreLoop:
    """The child's loop over one engine: commands in, one step, its reports out."""

    def __init__(self, conn: Connection, engine: Engine, compiling: bool):
        self.conn, self.engine = conn, engine
        self.reports: list[RequestOutput] = []
        self.finished: list[RequestOutput] = []
        self.stats_sent = 0.0
        self.compiling_sent = compiling  # as the last stats sent said
        engine.add_finish_observer(self.finished.append)

    def run(self) -> None:
        with self.engine.core.runner.forward.stepping():  # the model is this process's alone
            while self._take_commands():
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    self.engine.step()
                except BaseException as error:  # what `Engine`'s own loop would die of: tell the other side
                    traceback.print_exc()
                    self.conn.send(("dead", describe(error)))
                    return
                self._send_step()
        self.engine.shutdown()  # aborts what is left: their last reports go out
        self._send_step(force=True)
        self.conn.send(("closed", None))

    def _take_commands(self) -> bool:
        """Apply every waiting command, blocking for one when the engine has nothing to do; False to stop."""
        block = not self.engine.has_unfinished_requests()
        while block or self.conn.poll(0):
            if block and self.compiling_sent and not self.conn.poll(COMPILE_POLL):
                if not self.engine.core.compiling:  # idle when the compile ended: the other side learns it now
                    self._send_step(force=True)
                continue
            try:
                command = self.conn.recv()
            except EOFError:  # the other side is gone
                return False
            block = False
            if command[0] == "shutdown":
                return False
            self._apply(command)
        return True

    def _apply(self, command: tuple) -> None:
        """An add, an abort, or an adapter to read or drop; an add the engine refuses (its id still held by a
        request being aborted) fails alone."""
        kind = command[0]
        if kind == "abort":
            self.engine.abort(command[1])
            return
        if kind == "remove_lora":
            self.engine.remove_lora(command[1])
            return
        if kind == "add_lora":  # read beside the steps (a folder read would stall every stream)
            threading.Thread(target=_read_adapter, args=(self.engine, command[1]), name="hf_accel-lora-read",
                             daemon=True).start()
            return
        request = command[1]
        try:
            self.engine.submit(request, self.reports.append)
        except ValueError as error:
            request.fail(error)
            self.reports.append(request.snapshot())

    def _send_step(self, force: bool = False) -> None:
        now = time.monotonic()
        if not (self.reports or self.finished or force or now - self.stats_sent >= STATS_INTERVAL):
            return
        step = StepReport(self.reports, self.finished, self.engine.stats())
        self.conn.send(("step", step))  # pickled now: the lists can be emptied in place (the listeners hold them)
        self.stats_sent, self.compiling_sent = now, step.stats.compiling
        self.reports.clear()
        self.finished.clear()


def _read_adapter(engine: Engine, request: LoRARequest) -> None:
    """`engine.add_lora` (thread-safe: the adapters in memory are locked); checked by the caller already, so a folder
    changed since then is only logged here: its requests fail alone when they arrive."""
    try:
        engine.add_lora(request)
    except (ValueError, TypeError, OSError) as error:
        logger.warning("reading LoRA adapter %r failed: %s", request.lora_name, error)
