"""Who hears about requests: one listener per open request (its outputs, or the error that killed the engine) and
observers of every finished request (metrics). Called in the stepping thread.

Rule: a listener or observer that raises is its own fault, never the engine's: the error is logged, and a listener
that raised hears nothing more (`deliver` returns False so the engine aborts its request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .outputs import RequestOutput

Listener = Callable[[RequestOutput | BaseException], None]
logger = logging.getLogger(__name__)


class Listeners:
    """The listeners of open requests, by request id, and the finish observers."""

    def __init__(self) -> None:
        self._by_request: dict[str, Listener] = {}
        self._finish_observers: list[Callable[[RequestOutput], None]] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def add(self, request_id: str, listener: Listener | None) -> None:
        self._by_request[request_id] = listener or (lambda out: None)

    def add_finish_observer(self, observer: Callable[[RequestOutput], None]) -> None:
        self._finish_observers.append(observer)

    def deliver(self, out: RequestOutput) -> bool:
        """Hand `out` to its request's listener (forgotten once finished) and, when finished, to every observer.
        False when the listener raised: it is forgotten and the request should be aborted."""
        listener = self._by_request.pop(out.request_id, None) if out.finished else self._by_request.get(out.request_id)
        heard = True
        if listener is not None:
            try:
                listener(out)
            except Exception:
                logger.exception("the listener of request %s raised; the request is aborted", out.request_id)
                self._by_request.pop(out.request_id, None)
                heard = False
        if out.finished:
            for observer in self._finish_observers:
                try:
                    observer(out)
                except Exception:
                    logger.exception("a finish observer raised on request %s", out.request_id)
        return heard

    def fail_all(self, error: BaseException) -> None:
        """Tell every open request's listener that the engine died, and forget them."""
        listeners, self._by_request = list(self._by_request.values()), {}
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                logger.exception("a listener raised while told that the engine died")
