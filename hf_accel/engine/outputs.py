"""What the engine hands back: one `RequestOutput` per request, one `CompletionOutput` per sample (vLLM's shape),
in one of vLLM's three output kinds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What a request's listener gets after a step that changes it (vLLM's names).

    CUMULATIVE: every sample whole so far. DELTA: only the samples that changed, each with only what is new since the
    last report: its new token ids (with their logprobs and times) and newly released text; a sample whose new
    tokens release no text yet (a partial character, or text that may start a stop string) waits for its text,
    unless it finished or the engine has no tokenizer. FINAL_ONLY: nothing until the request finishes, then every
    sample whole.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of the chosen token and of the `k` most likely tokens at that step (from the raw logits)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestTiming:
    """Wall-clock times (`time.perf_counter()` seconds) of a request's milestones; None until reached."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why a request failed alone: the error's type and message, and whether its own parameters caused it (a
    ValueError / TypeError / OverflowError: the server answers 400) or not (500)."""

    type: str
    message: str
    is_client_error: bool

    @classmethod
    def from_exception(cls, error: BaseException) -> RequestError:
        return cls(type(error).__name__, str(error), isinstance(error, (ValueError, TypeError, OverflowError)))

    def __str__(self) -> str:  # as `errors.describe` names the error it came from
        return f"{self.type}: {self.message}"


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request: cumulative `token_ids` and `text` so far, `finish_reason` once done
    ("stop": EOS, a stop token or a stop string; "length": `max_tokens` or the model's context; "abort"; "error":
    handling the request raised, see `RequestOutput.error`)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    logprobs: list[TokenLogprob] | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter() when each token was produced

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state: `outputs` holds its `n` samples (in a DELTA report, only those that changed, by their
    `index`). `token_ids`, `text` and `finish_reason` are the first listed sample's, for the common `n == 1` case."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    timing: RequestTiming
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: RequestError | None = None  # set when handling this request raised; every sample ends with "error"
    finished: bool = False  # every sample has finished (the request's last report)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
