"""OpenAI-style errors: one exception type, one body shape, and the handlers that guarantee it.

Every error a client sees has the body ``{"error": {"message", "type", "param", "code"}}``. Handlers convert
our own :class:`APIError`, pydantic validation errors (``param`` names the field), FastAPI's request
validation errors and Starlette's HTTP errors (unknown route, wrong method); anything else becomes a 500 with
a generic message while the traceback goes to the server log only.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from specserve.engine.async_engine import (
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestTimeoutError,
)

log = logging.getLogger("specserve.server")

RETRY_AFTER_SECONDS = 1
# Parts of a pydantic error location that name a union member or a type, not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|list)$|\[|^function-|^[A-Z]")


class APIError(Exception):
    """An error reported to the client with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped JSON: a message may quote client input, which can hold lone surrogates.
        return Response(
            json.dumps(self.body(), ensure_ascii=True),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def queue_full(message: str) -> APIError:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return APIError(429, message, "rate_limit_error", code="rate_limit_exceeded", headers=headers)


def unavailable(message: str, code: str) -> APIError:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return APIError(503, message, "service_unavailable", code=code, headers=headers)


def timed_out(message: str) -> APIError:
    return APIError(504, message, "timeout_error", code="request_timeout")


def internal_error() -> APIError:
    return APIError(
        500, "The server had an internal error; it has been logged.", "server_error", code="internal"
    )


def param_name(loc: Sequence[int | str]) -> str | None:
    """``("messages", 0, "content", "str")`` → ``"messages[0].content"`` (union member tags dropped)."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            name += f".{part}" if name else part
    return name or None


def from_validation(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first validation error as a 400, naming the field in ``param`` and in the message."""
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    param = param_name(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return invalid_request(f"The request body is not valid JSON: {message}")
    if param is None:
        return invalid_request(f"Invalid request body: {message}")
    if first.get("type") == "missing":
        return invalid_request(f"Missing required field '{param}'.", param=param)
    return invalid_request(f"Invalid value for '{param}': {message}", param=param)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (asked route by route, method by method)."""
    routes = request.app.router.routes
    return [
        method
        for method in HTTP_METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    ]


def install_handlers(app: FastAPI) -> None:
    """Make every error response, including unexpected ones, use the OpenAI body shape."""

    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return from_validation(exc.errors()).response()

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        code = codes.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names only the first route's methods when a path has several
            headers["Allow"] = ", ".join(allowed_methods(request))
        return APIError(exc.status_code, str(exc.detail), code=code, headers=headers).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return internal_error().response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


def from_engine_error(exc: BaseException) -> APIError | None:
    """The client-facing error for an exception out of ``AsyncEngine.generate``; None if unexpected."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return queue_full(f"The server is busy ({exc}); retry later.")
    if isinstance(exc, RequestTimeoutError):
        return timed_out(f"The request timed out: {exc}.")
    if isinstance(exc, EngineDeadError):
        return unavailable("The engine stopped; see the server log.", "engine_stopped")
    if isinstance(exc, RequestFailedError):  # logged with its traceback by the engine
        return internal_error()
    if isinstance(exc, ValueError):  # the engine refused the request (add_request's checks)
        return invalid_request(str(exc))
    return None
