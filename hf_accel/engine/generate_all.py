"""`generate_all`: blocking generation for a batch of prompts over any engine that takes requests with listeners
(`Engine` in-process, `EngineProcess` in its own process): add them all, wait until every one has finished, return
the final outputs in prompt order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import EngineDeadError
from .output_stream import RequestSink
from .outputs import RequestOutput, RequestOutputKind
from .prompts import Prompt, prompt_list
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..lora.config import LoRARequest


def generate_all(engine: RequestSink, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None,
                 wait: Callable[[threading.Event], None],
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
    """Add one request per prompt (`params` and `lora_request`: one for all or one per prompt) and call
    `wait(done)`, which returns once `done` is set (by waiting for a loop that steps elsewhere, or by stepping). A
    request that failed alone has finish_reason "error"; if the engine died, EngineDeadError. If adding one raises,
    those added are aborted."""
    prompts = prompt_list(prompts)
    per_prompt = _per_prompt("params", params, len(prompts))
    adapters = _per_prompt("lora_request", lora_request, len(prompts))
    finished: dict[str, RequestOutput] = {}
    errors: list[BaseException] = []  # what killed the engine loop, if it died
    done = threading.Event()
    ids: list[str] = []

    def collect(out: RequestOutput | BaseException) -> None:
        if isinstance(out, BaseException):
            errors.append(out)
        elif out.finished:
            finished[out.request_id] = out
        if errors or len(finished) == len(ids):
            done.set()

    try:
        for prompt, prompt_params, adapter in zip(prompts, per_prompt, adapters):
            ids.append(engine.add_request(prompt, prompt_params, None, collect, RequestOutputKind.FINAL_ONLY,
                                          adapter))
    except BaseException:
        for request_id in ids:
            engine.abort(request_id)
        raise
    if len(finished) == len(ids):  # every request finished (or failed) while the others were added
        done.set()
    wait(done)
    if errors:
        raise EngineDeadError("the engine loop died") from errors[0]
    return [finished[i] for i in ids]


def _per_prompt(name: str, value: Any, count: int) -> list[Any]:
    """`value` for each of `count` prompts: a list or tuple gives one each, anything else is shared."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise ValueError(f"`{name}` has {len(values)} entries for {count} prompts")
    return values
