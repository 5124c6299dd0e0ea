"""The engine-core process's side of `EngineProcess` (engine_process.py): build the engine, report ready, then loop:
take the commands waiting on the pipe (block only when idle), run one step, send that step's reports, the whole
output of every request that finished, and the engine's stats, in one message. Messages to it: `("add", Request)`,
`("abort", request_id)`, `("shutdown",)`; from it: `("ready", Ready)` or `("failed", reason)`, then
`("step", StepReport)`, and last `("dead", reason)` or `("closed", None)`."""

from __future__ import annotations

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
from .step_forward import paged_attention_implementation


@dataclass(frozen=True, slots=True)
class Ready:
    """What the child sends once its engine is built."""

    limits: EngineLimits
    config: EngineConfig
    stats: EngineStats


@dataclass(slots=True)
class StepReport:
    """What the child sends after a step: the listeners' reports in order, the whole output of each request that
    finished (the same objects as its report unless it streams deltas: pickling keeps one copy), the stats."""

    reports: list[RequestOutput]
    finished: list[RequestOutput]
    stats: EngineStats


def run_engine_core(conn: Connection, factory: Callable[[], Engine]) -> None:
    """The child's main: build the engine, report ready (or why not), then serve the pipe until told to stop or the
    other end closes."""
    try:
        engine = factory()
    except BaseException as error:
        traceback.print_exc()
        conn.send(("failed", describe(error)))
        return
    conn.send(("ready", Ready(engine.core.limits, engine.config, engine.stats())))
    _CoreLoop(conn, engine).run()


class _CoreLoop:
    """The child's loop over one engine: commands in, one step, its reports out."""

    def __init__(self, conn: Connection, engine: Engine):
        self.conn, self.engine = conn, engine
        self.reports: list[RequestOutput] = []
        self.finished: list[RequestOutput] = []
        engine.add_finish_observer(self.finished.append)

    def run(self) -> None:
        with paged_attention_implementation(self.engine.core.model):  # the model is this process's alone
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
        self._send_step()
        self.conn.send(("closed", None))

    def _take_commands(self) -> bool:
        """Apply every waiting command, blocking for one when the engine has nothing to do; False to stop."""
        block = not self.engine.has_unfinished_requests()
        while block or self.conn.poll(0):
            try:
                command = self.conn.recv()
            except EOFError:  # the other side is gone
                return False
            block = False
            if command[0] == "add":
                self.engine.submit(command[1], self.reports.append)
            elif command[0] == "abort":
                self.engine.abort(command[1])
            elif command[0] == "shutdown":
                return False
        return True

    def _send_step(self) -> None:
        if not self.reports and not self.finished:
            return
        step = StepReport(self.reports, self.finished, self.engine.stats())
        self.conn.send(("step", step))  # pickled now: the lists can be emptied in place (the listeners hold them)
        self.reports.clear()
        self.finished.clear()
