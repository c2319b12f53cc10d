"""Relaying one HTTP exchange between the front and an engine replica, failures included.

The replica's response comes back as :class:`~specserve.rayserve.asgi_bridge.Part` items and is sent on as
it arrives, SSE included. A replica that dies mid-request: a stream that already started ends with an SSE
error event and a closed stream; a request that had not started gets 503 ``replica_failed`` (its client may
retry: Serve routes the retry to a live replica). Every full queue is a 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from specserve.rayserve.asgi_bridge import HTTPCall, Part
from specserve.rayserve.metrics_merge import FrontMetrics
from specserve.server.errors import APIError

log = logging.getLogger("specserve.rayserve")


def incoming_call(request: Request, body: bytes, request_id: str) -> HTTPCall:
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"x-request-id"]
    client = request.client
    return HTTPCall(
        method=request.method,
        path=request.url.path,
        query=request.scope.get("query_string", b""),
        headers=[*headers, (b"x-request-id", request_id.encode())],
        body=body,
        client=(client.host, client.port) if client is not None else None,
    )


class RelayResponse(Response):
    """The replica's response, relayed part by part; a replica lost mid-stream ends the stream cleanly."""

    def __init__(self, first: Part, rest: AsyncIterator[Part], cancel: Any, metrics: FrontMetrics) -> None:
        self.first, self.rest, self.cancel, self.metrics = first, rest, cancel, metrics
        self.status_code = first.status
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Serve's proxy sets its own X-Request-ID (the same id: the front passed it on).
        dropped = (b"content-length", b"x-request-id")
        headers = [(k, v) for k, v in self.first.headers if k.lower() not in dropped]
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        try:
            async for part in self.rest:
                await send({"type": "http.response.body", "body": part.body, "more_body": True})
                if not part.more:
                    break
        except Exception as exc:
            log.warning("replica lost during a response: %s", exc)
            self.metrics.failures.labels("replica_failed").inc()
            if sse:
                error = replica_failed("The replica serving this stream failed; retry the request.")
                event = f"data: {json.dumps(error.body())}\n\n".encode()
                await send({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            self.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def replica_failed(message: str) -> APIError:
    return APIError(503, message, "server_error", code="replica_failed", headers={"Retry-After": "1"})


async def relay(replicas: Any, call: HTTPCall, metrics: FrontMetrics) -> Response:
    """Send ``call`` to a replica through the engine deployment's streaming handle; errors before the
    response starts become OpenAI errors."""
    from ray.serve.exceptions import BackPressureError

    responses = replicas.handle.remote(call)
    try:
        first = await responses.__anext__()
    except BackPressureError:
        metrics.failures.labels("queue_full").inc()
        raise APIError(
            429, "All replicas are busy and the front's queue is full; retry later.", "server_error",
            code="queue_full", headers={"Retry-After": "1"},
        ) from None  # fmt: skip
    except asyncio.CancelledError:
        responses.cancel()
        raise
    except Exception as exc:
        log.warning("replica failed before responding: %s", exc)
        metrics.failures.labels("replica_failed").inc()
        raise replica_failed("The replica serving this request failed; retry the request.") from None
    metrics.routed(first.headers)
    return RelayResponse(first, responses, responses.cancel, metrics)
