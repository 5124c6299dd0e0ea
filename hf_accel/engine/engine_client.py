"""`EngineClient`: the request API that `Engine` (in this process) and `EngineProcess` (an engine-core process of its
own) share, vLLM's name for it. A request is checked in the caller's thread (`Admission`), registered with its
listener under an id no open request holds, then handed to whichever side steps (`submit`)."""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from .admission import Admission
from .generate_all import generate_all
from .limits import EngineLimits
from .listeners import Listener, Listeners
from .output_stream import stream_request
from .outputs import RequestOutput, RequestOutputKind
from .sampling_params import SamplingParams
from .sequence import Request

if TYPE_CHECKING:
    from ..lora.config import LoRARequest


class EngineClient(ABC):
    """What both engines share. A subclass sets `limits`, `_admission`, `_listeners` and `_dead` (what killed it, or
    None) and defines `submit` (register and queue a checked request), `abort`, `start` (the stepping side running;
    EngineDeadError once dead) and `_run_until(done)` (return once the event is set)."""

    limits: EngineLimits
    _admission: Admission
    _listeners: Listeners
    _dead: BaseException | None

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._dead is None

    @property
    def compiling(self) -> bool:
        """Whether the model step's graphs are still compiling in the background (`EngineConfig.
        compile_in_background`): requests are served meanwhile, by eager steps."""
        return self.stats().compiling

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, listener: Listener | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request (thread-safe); returns its id. `listener` gets a `RequestOutput` after every step that
        changes it, of `output_kind` (in the thread that delivers the engine's reports), or the error that killed the
        engine; `lora_request` runs it with that LoRA adapter (an engine built with `lora=`). Raises ValueError /
        TypeError for bad prompts, parameters or adapters (`ContextLengthExceededError` when it cannot fit),
        EngineDeadError once the engine has died."""
        self._check_alive()
        request = self._admission.request(prompt, params, request_id, output_kind, lora_request)
        self.submit(request, listener)
        return request.request_id

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter ahead of its first request (vLLM's `add_lora`): ValueError / TypeError naming
        what keeps it from being served (an engine without `lora=`, a folder that does not fit the base, an id
        bound to another folder)."""
        self._check_alive()
        self._admission.check_lora(lora_request)

    @abstractmethod
    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter from the engine's memory now and from its slot once no running request uses it (vLLM's
        `remove_lora`); a later request with its id reads the folder again."""

    @abstractmethod
    def submit(self, request: Request, listener: Listener | None = None) -> None:
        """Queue a request already checked by an `Admission` against this engine's limits (thread-safe);
        ValueError when its id is in use."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request at the next step, freeing its blocks (unknown ids ignored)."""

    @abstractmethod
    def start(self) -> None:
        """Make sure the stepping side runs; EngineDeadError once the engine has died."""

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); `params` is one for all or one per prompt, and so
        is `lora_request` (None: the base model). Returns the finished outputs in prompt order; a request that
        failed alone has finish_reason "error" and its `error` set, the others are unaffected."""
        return generate_all(self, prompts, params, self._run_until, lora_request)

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None,
                     output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changes it (`output_kind`: the whole output so far by
        default, or only what is new with `RequestOutputKind.DELTA`), the last one finished; `lora_request` runs it
        with that adapter. Leaving the loop early (or cancelling the task) aborts the request and frees its
        blocks."""
        self.start()
        # closed with this generator (not when the garbage collector finds it): the abort is sent right away
        async with contextlib.aclosing(stream_request(self, prompt, params, request_id, output_kind,
                                                      lora_request)) as outputs:
            async for out in outputs:
                yield out

    def add_finish_observer(self, observer: Callable[[RequestOutput], None]) -> None:
        """Call `observer` with every finished request's whole output, in the thread that delivers the engine's
        reports (metrics)."""
        self._listeners.add_finish_observer(observer)

    def _register(self, request: Request, listener: Listener | None) -> None:
        """Give `request` its listener; ValueError when its id is held by an open request."""
        if request.request_id in self._listeners:
            raise ValueError(f"`request_id` {request.request_id!r} is already in use")
        self._listeners.add(request.request_id, listener)

    @abstractmethod
    def _run_until(self, done: threading.Event) -> None:
        """Return once `done` is set (by waiting for whoever steps, or by stepping)."""

    @abstractmethod
    def _check_alive(self) -> None:
        """EngineDeadError once the engine has died or was shut down."""
