"""The engine's own exceptions."""

from __future__ import annotations


class ContextLengthExceededError(ValueError):
    """A prompt plus `max_tokens` does not fit in the model's context (`max_model_len`)."""


class EngineDeadError(RuntimeError):
    """The engine's background loop stopped on an error; the original error is the `__cause__`."""
