"""`ServerState`: what every route of one app shares (engine, tokenizer, served name and adapters, waiting bound,
metrics)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from ..lora.config import LoRARequest
from .adapters import ServedAdapters
from .served_engine import ServedEngine
from .errors import APIError, model_not_found
from .generation import EngineRequests, WaitingRequests
from .metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    """One app's engine and settings; routes reach it through the `server_state` dependency."""

    engine: ServedEngine
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    waiting: WaitingRequests
    metrics: ServerMetrics
    adapters: ServedAdapters
    created: int = field(default_factory=lambda: int(time.time()))

    def model_adapter(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model, also when `model` is missing); 404 for a name
        that is neither."""
        if model is None or model == self.model_name:
            return None
        adapter = self.adapters.find(model)
        if adapter is None:
            raise model_not_found(model, [self.model_name, *(a.lora_name for a in self.adapters)])
        return adapter

    def served_model(self, model: str | None) -> str:
        """The name responses carry: the requested model, or the base's when the request named none."""
        return self.model_name if model is None else model

    def new_requests(self, prefix: str, n: int, model: str | None) -> tuple[str, EngineRequests]:
        """A fresh response id (`{prefix}-<hex>`) and the engine-request group under it (`n` samples a prompt), run
        by the base or the adapter `model` names (404 for an unknown name)."""
        adapter = self.model_adapter(model)
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        return response_id, EngineRequests(self.engine, self.waiting, response_id, n, adapter, self.adapters)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to `messages` (and `tools`, which the template renders); 400 when the tokenizer
        has none or the template refuses them."""
        if not self.tokenizer.chat_template:
            raise APIError(400, f"The tokenizer of `{self.model_name}` has no chat template, so `messages` cannot be "
                                "turned into a prompt; use /v1/completions instead.", param="messages",
                           code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except (TemplateError, ValueError) as error:  # the template refuses these messages (roles must alternate...)
            raise APIError(400, f"The chat template rejected `messages`: {error}", param="messages",
                           code="invalid_value") from error

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's `ServerState`; 503 while the engine is still loading (or failed to)."""
    server = request.app.state.server
    if server is None:
        raise APIError(503, "The model is still loading; retry once GET /health answers 200.", code="model_loading",
                       error_type="service_unavailable_error")
    return server
