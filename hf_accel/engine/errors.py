"""The engine's own exceptions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class ContextLengthExceededError(ValueError):
    """A prompt plus `max_tokens` does not fit in the model's context (`max_model_len`)."""


def describe(error: BaseException) -> str:
    """`"<type>: <message>"`, how the engine and the server name an error."""
    return f"{type(error).__name__}: {error}"


class EngineDeadError(RuntimeError):
    """The engine's background loop stopped on an error; the original error is the `__cause__`."""

    @property
    def reason(self) -> str | None:
        """What stopped the loop (`describe` of the cause), if known."""
        return None if self.__cause__ is None else describe(self.__cause__)


def each_alone_on_error(run: Callable[[list[T]], object], items: Sequence[T],
                        failed: Callable[[T, Exception], None]) -> None:
    """`run(items)`; when it raises, `run([item])` for each item alone, and `failed(item, error)` for those that still
    raise: one request's fault fails that request alone."""
    try:
        run(list(items))
    except Exception:
        for item in items:
            try:
                run([item])
            except Exception as error:
                failed(item, error)
