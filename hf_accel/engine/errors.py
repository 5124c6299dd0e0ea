"""The engine's own exceptions."""

from __future__ import annotations


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
