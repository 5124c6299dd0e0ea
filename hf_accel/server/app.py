"""`create_app`: the OpenAI-compatible HTTP app over one engine (routes in their own files, this one wires them).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, with `allow_runtime_lora` `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`
(behind the API key when one is set), `GET /health`, `GET /metrics` (always open, as in vLLM).
The app starts the engine's loop on startup and shuts the engine down on shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from transformers import PreTrainedTokenizerBase

from ..cache.settings import check_int
from ..engine.errors import describe
from . import adapter_routes, chat, completions, tokenization
from .adapters import ServedAdapters
from .errors import APIError, engine_dead, install_error_handlers
from .generation import WaitingRequests
from .metrics import ServerMetrics
from .responses import ModelCard, ModelList
from .served_engine import ServedEngine
from .startup import EngineLoad
from .state import ServerState, server_state

DEFAULT_MAX_QUEUE_LEN = 1024

open_routes = APIRouter()
model_routes = APIRouter()


@model_routes.get("/v1/models")
async def list_models(server: ServerState = Depends(server_state)) -> ModelList:
    """The served model, with its `max_model_len`, then each LoRA adapter (`parent`: the base, `root`: its
    folder)."""
    length = server.engine.max_model_len
    base = ModelCard(id=server.model_name, created=server.created, root=server.model_name, max_model_len=length)
    adapters = [ModelCard(id=a.lora_name, created=server.created, root=str(a.lora_path), parent=server.model_name,
                          max_model_len=length) for a in server.adapters]
    return ModelList(data=[base, *adapters])


@open_routes.get("/health")
async def health(request: Request) -> Response:
    """vLLM's readiness: 200 once requests are served (`{"status": "ready"}`, or `"compiling"`: eager steps serve
    them while the graphs compile), 503 while the engine loads (`"loading"`), when loading it failed (`"failed"`)
    and once its loop has died (the error, with the reason)."""
    load: EngineLoad = request.app.state.load
    status = load.status
    if status == "failed":
        return JSONResponse({"status": status, "error": describe(load.error)}, status_code=503)
    if load.engine is not None and not load.engine.is_healthy:
        return engine_dead(load.engine.dead_reason).response()
    return JSONResponse({"status": status}, status_code=503 if status == "loading" else 200)


@open_routes.get("/metrics")
async def metrics(server: ServerState = Depends(server_state)) -> Response:
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def api_key_check(api_key: str) -> Callable[[Request], Coroutine[None, None, None]]:
    """Dependency: 401 unless the request carries `Authorization: Bearer <api_key>` (compared in constant time)."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key", error_type="authentication_error")

    return check


def create_app(engine: ServedEngine | Callable[[], ServedEngine], tokenizer: PreTrainedTokenizerBase, model_name: str,
               api_key: str | None = None, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
               on_load_error: Callable[[BaseException], None] | None = None,
               lora_modules: Mapping[str, str] | None = None, allow_runtime_lora: bool = False) -> FastAPI:
    """The HTTP app serving `engine` as model `model_name`.

    Args:
        engine: the engine to serve, or a function that builds it: then the app answers from the start, building it
            in a thread (`/health` says `loading`, other routes 503 `model_loading` until it is built).
            Its loop starts with the app (or once built) and it is shut down when the app stops.
        tokenizer: the engine's tokenizer (chat template, /tokenize, logprob token strings).
        model_name: the `model` clients name (others get 404) and /v1/models lists.
        api_key: when set, the /v1 routes and /tokenize, /detokenize need `Authorization: Bearer <api_key>`.
        max_queue_len: most requests waiting for their first token; more get 429.
        on_load_error: called (in the loading thread) with what building the engine raised (`hf-accel serve`
            stops there).
        lora_modules: LoRA adapters served from the start, model name -> peft adapter folder (the engine must be
            built with `lora=`); a folder that cannot be served fails the start, as a model that cannot be built.
        allow_runtime_lora: serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    """
    _check_settings(model_name, api_key, max_queue_len)

    def serve(built: ServedEngine) -> None:
        built.start()
        adapters = ServedAdapters.at_start(built, model_name, lora_modules or {})
        app.state.server = ServerState(built, tokenizer, model_name, WaitingRequests(max_queue_len),
                                       ServerMetrics(built, model_name), adapters)

    app = FastAPI(title="hf_accel", lifespan=_lifespan(engine, serve, on_load_error or (lambda error: None)))
    app.state.load = EngineLoad()
    app.state.server = None  # set once the engine is built
    install_error_handlers(app)
    _include_routes(app, api_key, allow_runtime_lora)
    return app


def _lifespan(engine: ServedEngine | Callable[[], ServedEngine], serve: Callable[[ServedEngine], None],
              on_load_error: Callable[[BaseException], None]):
    """The app's lifespan: the engine loaded (or built) and served at start, shut down at the end."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.load.begin(engine, serve, on_load_error)
        try:
            yield
        finally:
            built = app.state.load.cancel()
            if built is not None:
                await asyncio.to_thread(built.shutdown)

    return lifespan


def _include_routes(app: FastAPI, api_key: str | None, allow_runtime_lora: bool) -> None:
    """Every route; those of /v1 and /tokenize, /detokenize behind `api_key` when it is set."""
    guarded = [] if api_key is None else [Depends(api_key_check(api_key))]
    routers = [completions.router, chat.router, tokenization.router, model_routes]
    for router in routers + ([adapter_routes.router] if allow_runtime_lora else []):
        app.include_router(router, dependencies=guarded)
    app.include_router(open_routes)


def _check_settings(model_name: str, api_key: str | None, max_queue_len: int) -> None:
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"`model_name` must be a non-empty string, got {model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("`api_key` must be a non-empty string or None")
    check_int("max_queue_len", max_queue_len, 1, "a positive int")
