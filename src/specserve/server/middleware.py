"""Around every HTTP request: its id, access control and, for generation requests, the end-of-request record.

Every request gets an id (the client's ``X-Request-ID`` if it is sane, else a new one), returned in the
``X-Request-ID`` response header and carried by every log line logged while serving it. A generation
request (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``) also gets a
:class:`RequestRecord` that the route fills in (its sequence, a streamed error); when the response is
complete, streams included, the record gives the outcome, feeds the request metrics and is logged as one
summary line.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.engine.output_processor import RequestOutput, RequestState
from specserve.logging import request_id_var
from specserve.server.errors import APIError, internal_error

if TYPE_CHECKING:
    from specserve.server.state import ServerState

log = logging.getLogger("specserve.server")
request_log = logging.getLogger("specserve.request")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
_SANE_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


@dataclass
class RequestRecord:
    """What a generation request did, filled in by the route as it goes."""

    request_id: str
    path: str
    start: float
    status: int = 0
    completion_id: str | None = None
    stream: bool = False
    request: RequestState | None = None
    stream_error: APIError | None = None
    """An error sent inside a 200 event stream (timeout, stopped engine)."""
    prompt: Any = None
    """The prompt or messages, kept only with log_prompts."""

    def watch(self, first: asyncio.Task[RequestOutput]) -> None:
        """Take the sequence from the request's first output, whoever consumes it."""

        def take(task: asyncio.Task[RequestOutput]) -> None:
            if not task.cancelled() and task.exception() is None:
                self.request = task.result().state

        first.add_done_callback(take)


record_var: ContextVar[RequestRecord | None] = ContextVar("specserve_request_record", default=None)


def current_record() -> RequestRecord | None:
    return record_var.get()


def note_stream_error(error: APIError) -> None:
    record = record_var.get()
    if record is not None:
        record.stream_error = error


def request_id_from(headers: Headers) -> str:
    given = headers.get("x-request-id", "")
    return given if _SANE_ID.match(given) else uuid.uuid4().hex


def outcome(record: RequestRecord) -> str:
    """One of ``metrics.OUTCOMES``."""
    status = record.stream_error.status if record.stream_error is not None else record.status
    if status == 200:
        request = record.request
        finished = request is not None and request.finish_reason in ("stop", "length")
        return "success" if finished else "aborted"
    if status == 429:
        return "rejected_429"
    if status == 499:  # the client left while sending its request (server/request_body.py)
        return "aborted"
    if status == 504:
        return "timed_out"
    if status in (401, 403):
        return "unauthorized"
    if status == 503:
        return "unavailable"
    return "invalid_request" if 400 <= status < 500 else "error"


def summary(record: RequestRecord, result: str, log_prompts: bool) -> dict[str, Any]:
    """The fields of a request's summary log line (no prompt or output text unless log_prompts)."""
    fields: dict[str, Any] = {
        "path": record.path,
        "status": record.status,
        "outcome": result,
        "completion_id": record.completion_id,
        "stream": record.stream,
        "total_s": round(time.perf_counter() - record.start, 4),
    }
    if record.stream_error is not None:
        fields["error"] = {"code": record.stream_error.code, "message": record.stream_error.message}
    request = record.request
    if request is None:
        return fields
    stats = request.stats
    fields.update(
        prompt_tokens=len(request.prompt_ids),
        cached_tokens=request.cached_tokens,
        output_tokens=len(request.output_ids),
        finish_reason=request.finish_reason,
        drafters=dict(stats.drafts_by_drafter),
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        mean_acceptance_length=round(stats.mean_acceptance_length, 4),
        first_rejections=list(stats.first_rejections),
        draft_s=round(request.draft_seconds, 4),
        verify_s=round(request.verify_seconds, 4),
        queue_s=_since(request.arrival_time, request.scheduled_time),
        ttft_s=_since(request.arrival_time, request.first_token_time),
    )
    if log_prompts:
        fields.update(prompt=record.prompt, output=request.text)
    return fields


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 4)


class OpsMiddleware:
    """Pure ASGI middleware (streams pass through untouched; the record ends when the body is sent)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = request_id_from(headers)
        path: str = scope["path"]
        record = RequestRecord(request_id, path, time.perf_counter()) if path in GENERATION_PATHS else None
        id_token, record_token = request_id_var.set(request_id), record_var.set(record)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["X-Request-ID"] = request_id
                if record is not None:
                    record.status = message["status"]
            await send(message)

        if record is not None:
            self.state.in_flight += 1
        try:
            client = scope.get("client")
            error = self.state.access.check(path, headers.get("authorization"), client[0] if client else "")
            if error is not None:
                await error.response()(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception as exc:  # the one place unexpected errors end: logged once, a generic 500 sent
            log.error("unhandled error in %s %s", scope.get("method"), path, exc_info=exc)
            if not started:
                await internal_error().response()(scope, receive, send_with_id)
        finally:
            if record is not None:
                self.state.in_flight -= 1
                self._finish(record)
            record_var.reset(record_token)
            request_id_var.reset(id_token)

    def _finish(self, record: RequestRecord) -> None:
        result = outcome(record)
        self.state.metrics.observe_request(result, record.request)
        fields = summary(record, result, self.state.settings.log_prompts)
        request_log.info("request finished", extra={"fields": fields})
