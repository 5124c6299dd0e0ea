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

    @property
    def has_finish_observers(self) -> bool:
        return bool(self._finish_observers)

    def deliver(self, out: RequestOutput) -> bool:
        """Hand `out` to its request's listener (forgotten once `out` is the last report). False when the listener
        raised: it is forgotten and the request should be aborted."""
        listener = self._by_request.pop(out.request_id, None) if out.finished else self._by_request.get(out.request_id)
        if listener is None:
            return True
        try:
            listener(out)
        except Exception:
            logger.exception("the listener of request %s raised; the request is aborted", out.request_id)
            self._by_request.pop(out.request_id, None)
            return False
        return True

    def observe_finished(self, out: RequestOutput) -> None:
        """Hand a finished request's whole output to every finish observer."""
        for observer in self._finish_observers:
            try:
                observer(out)
            except Exception:
                logger.exception("a finish observer raised on request %s", out.request_id)

    def fail_all(self, error: BaseException) -> None:
        """Tell every open request's listener that the engine died, and forget them."""
        listeners, self._by_request = list(self._by_request.values()), {}
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                logger.exception("a listener raised while told that the engine died")
