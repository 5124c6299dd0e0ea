"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the handlers that produce them.

Statuses: 400 for request validation (pydantic: wrong types, missing fields, unsupported fields) and malformed JSON,
naming the field; 400 for `SamplingParams`' and the engine's own ValueError / TypeError (their messages name the
field in backticks), with code `context_length_exceeded` when a prompt plus `max_tokens` cannot fit; 401 without the
API key; 404 for unknown paths and models; 429 when the waiting queue is full; 400 (the request's own parameters
caused it) or 500 (anything else) with code `request_failed` when handling one request raised in the engine, which
goes on serving the others; 503 once the engine loop has died, with the reason.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.errors import EngineDeadError
from ..engine.limits import ContextLengthExceededError
from ..engine.outputs import RequestError

_FIELD_IN_MESSAGE = re.compile(r"`(\w+)`")


class APIError(Exception):
    """An error the client sees as `status` with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(error: ValueError | TypeError) -> APIError:
    """400 for a ValueError / TypeError raised by hf_accel's checks (their messages name the field in backticks);
    a prompt that cannot fit gets code `context_length_exceeded`."""
    message = str(error)
    match = _FIELD_IN_MESSAGE.search(message)
    param = match.group(1) if match else None
    if isinstance(error, ContextLengthExceededError):
        return APIError(400, message, param=param, code="context_length_exceeded")
    return APIError(400, message, param=param, code="invalid_value" if isinstance(error, ValueError) else
                    "invalid_type")


def engine_dead(reason: str | None = None) -> APIError:
    """503: the engine loop died (`reason`: what stopped it, as `Engine.dead_reason` gives it)."""
    because = f" ({reason})" if reason else ""
    return APIError(503, f"The engine loop died{because}; the server cannot generate any more.", code="engine_dead",
                    error_type="service_unavailable_error")


def request_failed(error: RequestError) -> APIError:
    """400 when the request's own parameters made the engine raise, 500 otherwise; the engine goes on serving."""
    status = 400 if error.is_client_error else 500
    return APIError(status, f"Generation failed for this request: {error}", code="request_failed")


def model_not_found(model: str, served: list[str]) -> APIError:
    """404 for a `model` this server does not serve (`served`: the base's name first, then its adapters')."""
    names = ", ".join(f"`{name}`" for name in served)
    return APIError(404, f"The model `{model}` does not exist: `model` must be one of {names} (or left out for "
                         f"`{served[0]}`).", param="model", code="model_not_found")


def validation_error(error: RequestValidationError) -> APIError:
    """400 naming the first invalid field (its path without "body" and pydantic's union tags), or saying the body is
    not JSON / not an object."""
    first = error.errors()[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    param = ".".join(str(part) for part in first.get("loc", ())[1:] if not _is_union_tag(part)) or None
    if param is None:
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    if kind == "missing":
        return APIError(400, f"Missing required field `{param}`.", param=param, code="missing_required_parameter")
    return APIError(400, f"Invalid value for `{param}`: {first.get('msg', 'invalid value')}", param=param,
                    code="invalid_type" if kind.endswith("_type") else "invalid_value")


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to OpenAI's error shape."""

    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(error.status_code).phrase
        message = error.detail if isinstance(error.detail, str) else phrase
        if error.status_code == 404:
            message = f"Not found: {request.url.path}"
        return APIError(error.status_code, message, code=phrase.lower().replace(" ", "_")).response()

    async def on_engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return engine_dead(error.reason).response()

    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"Internal server error: {type(error).__name__}: {error}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
