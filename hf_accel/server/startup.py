"""`EngineLoad`: the served engine built in a thread while the app already answers `/health`, and the readiness that
`/health` reports (vLLM's semantics: 200 once requests are served, 503 before and after).

States, in `/health`'s body (`{"status": ...}`):
- `loading` (503): the engine is being built: weights, kernels, and the compile unless it runs in the background;
- `compiling` (200): requests are served, by eager steps, while the graphs compile in the background
  (`EngineConfig.compile_in_background`); the first step after the compile switches to them;
- `ready` (200): served by the engine as it will stay;
- `failed` (503): building the engine raised (`error` says why); `hf-accel serve` then exits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..engine.engine_client import EngineClient
from .served_engine import ServedEngine

logger = logging.getLogger(__name__)


class EngineLoad:
    """The served engine: handed over built (`serve_now`), or built by `start(build, ...)` in a daemon thread, which
    hands it to `on_built`, or the error to `on_failed` (both called in that thread). An engine built after `cancel`
    (the app stopped while it loaded) is shut down instead."""

    def __init__(self):
        self._lock = threading.Lock()
        self.engine: ServedEngine | None = None
        self.error: BaseException | None = None
        self._cancelled = False

    @property
    def status(self) -> str:
        """`loading`, `failed`, `compiling` or `ready` (see the module docstring)."""
        if self.error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        return "compiling" if self.engine.compiling else "ready"

    def begin(self, engine: ServedEngine | Callable[[], ServedEngine], on_built: Callable[[ServedEngine], None],
              on_failed: Callable[[BaseException], None]) -> None:
        """Serve `engine` now if it is built, else build it in the background (`start`)."""
        if isinstance(engine, EngineClient):
            self.serve_now(engine, on_built)
        else:
            self.start(engine, on_built, on_failed)

    def serve_now(self, engine: ServedEngine, on_built: Callable[[ServedEngine], None]) -> None:
        """Serve an engine built already (`on_built` called here)."""
        on_built(engine)
        self.engine = engine

    def start(self, build: Callable[[], ServedEngine], on_built: Callable[[ServedEngine], None],
              on_failed: Callable[[BaseException], None]) -> None:
        def run() -> None:
            engine = None
            try:
                engine = build()
                with self._lock:
                    if not self._cancelled:
                        on_built(engine)
                        self.engine = engine
                        return
                engine.shutdown()
            except BaseException as error:
                logger.error("building the served engine failed", exc_info=error)
                if engine is not None:  # built, but serving it failed: nothing may keep running
                    engine.shutdown()
                self.error = error
                on_failed(error)

        threading.Thread(target=run, name="hf_accel-engine-load", daemon=True).start()

    def cancel(self) -> ServedEngine | None:
        """The app stops: the engine if it was built (to shut down), else None (one built later is shut down)."""
        with self._lock:
            self._cancelled = True
            return self.engine
