"""`Admission`: what a caller submits (a prompt, `SamplingParams`, an id, an output kind) checked and turned into a
`Request`, in the caller's thread, so that bad input raises there (ValueError / TypeError naming the argument) and
never reaches the stepping loop. `Engine` and `EngineProcess` each hold one; the request it builds is what the
stepping side queues (in the same process, or sent to the engine-core process)."""

from __future__ import annotations

import itertools
import time

from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from .limits import EngineLimits, check_request
from .outputs import RequestOutputKind, RequestTiming
from .prompts import Prompt, encode_prompt
from .sampling_params import SamplingParams
from .sequence import Request
from .structured_requests import check_structured_outputs

if TYPE_CHECKING:
    from ..lora.adapter_check import AdapterChecker
    from ..lora.config import LoRARequest


class Admission:
    """Builds checked requests against one engine's `limits`, encoding string prompts with `tokenizer` and reading
    LoRA adapters with `adapters` (None: the engine serves none); ids it makes up are `req-0`, `req-1`, ...,
    arrival order is the order of `request` calls."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, limits: EngineLimits,
                 adapters: AdapterChecker | None = None):
        self.tokenizer, self.limits, self.adapters = tokenizer, limits, adapters
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                output_kind: RequestOutputKind, lora_request: LoRARequest | None = None) -> Request:
        """A `Request` of `prompt` under `params` (default `SamplingParams()`), with `lora_request`'s adapter;
        raises ValueError / TypeError for a bad prompt, parameters, constraint, output kind or adapter
        (`ContextLengthExceededError` when it cannot fit)."""
        if not isinstance(output_kind, RequestOutputKind):
            raise TypeError(f"`output_kind` must be a RequestOutputKind, got {output_kind!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"`params` must be a SamplingParams, got {type(params).__name__}")
        text, ids = encode_prompt(self.tokenizer, prompt)
        check_request(ids, params, self.limits)
        constraint_key = None if params.structured_outputs is None else \
            check_structured_outputs(self.tokenizer, params.structured_outputs)
        if lora_request is not None:
            self.check_lora(lora_request)
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        return Request(request_id, text, ids, params, next(self._arrivals), RequestTiming(time.perf_counter()),
                       output_kind=output_kind, lora_request=lora_request,
                       constraint_key=constraint_key)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError / TypeError unless the engine serves adapters and `lora_request`'s can be served."""
        if self.adapters is None:
            raise ValueError("`lora_request` needs an engine built with `lora=hf_accel.LoRAConfig(...)`")
        self.adapters.check(lora_request)
