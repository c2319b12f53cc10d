"""Reading a request body under the server's limits (/v1 and /admin): JSON only, a size cap, a time limit."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from specserve.server.errors import APIError, from_validation, invalid_request

CLIENT_CLOSED = 499  # nginx's status for a request its client abandoned; never seen by that client


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The JSON body, refused with 415 if not JSON, 413 past ``limit`` bytes (at once when Content-Length
    says so), 408 if it takes longer than ``timeout`` seconds to arrive.

    Only ``application/json``: a body a browser can send cross-site without a preflight (text/plain, forms)
    must not make a keyless localhost server generate."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(
            415,
            "The request body must be JSON (Content-Type: application/json).",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size, too_large
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                too_large = True
                return
            chunks.append(chunk)

    if not too_large:
        try:
            await asyncio.wait_for(read(), timeout)
        except ClientDisconnect:  # gone while sending: nobody to answer, nothing to log but the outcome
            raise APIError(
                CLIENT_CLOSED, "The client closed the request.", code="client_closed_request"
            ) from None
        except TimeoutError:
            raise APIError(
                408, f"The request body did not arrive within {timeout:g} s.", code="timeout"
            ) from None
    if too_large:
        raise APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    return b"".join(chunks)


def json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be one JSON object; undecodable, malformed or absurdly nested input is a 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(
            f"The request body is not valid UTF-8 (bad byte at offset {exc.start})."
        ) from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}).") from None
    except (ValueError, RecursionError):  # e.g. an integer with thousands of digits, or absurd nesting
        raise invalid_request("The request body is not acceptable JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_model(request: Request, schema: type[ModelT], limit: int, timeout: float) -> ModelT:
    """:func:`read_body`, then the body validated as ``schema``; any problem is a 4xx naming it."""
    raw = await read_body(request, limit, timeout)
    try:
        return schema.model_validate(json_object(raw))
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None
