"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses request runs on the chat completions path, ``app.generate``: the body is read under the same
limits, the request translated into a chat request (server/responses_api.py) and admitted, generated and
counted exactly as a chat request (keys, rate limit, queue and its 429, 503 while not ready, metrics and
the request's log line). Only the body and the response differ, which :class:`ChatAPI` lets an API supply.
Errors name the Responses fields (``input`` for the messages, ``text.format``, ``max_output_tokens``).

Responses are stored (``store``, default true) in a :class:`ResponseStore` per API key: ``GET`` returns
one, ``DELETE`` removes it, ``previous_response_id`` continues its conversation. An id that is unknown,
evicted, deleted, or stored under another key is a 404 for ``GET``/``DELETE`` (``response_not_found``) and,
as OpenAI answers it, a 400 for ``previous_response_id`` (``previous_response_not_found``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from fastapi import APIRouter, Request
from starlette.responses import Response

from specserve.config import Settings
from specserve.engine.async_engine import AsyncEngine
from specserve.server import chat_request as c
from specserve.server.chunks import ChunkFormat
from specserve.server.errors import APIError, invalid_request
from specserve.server.response_store import ResponseStore
from specserve.server.responses_api import (
    ResponsesChatRequest,
    ResponsesRequest,
    chat_request,
    parse_responses_request,
)
from specserve.server.responses_items import history_items, stored_items
from specserve.server.responses_output import (
    DeletedResponse,
    ResponseFrame,
    ResponseObject,
    complete,
    conversation_output,
    new_id,
)
from specserve.server.responses_stream import response_events
from specserve.server.state import ServerState
from specserve.server.streaming import Choice, EventStreamResponse, collect, release_choices


class ChatAPI(Protocol):
    """An API served on the chat completions path (``app.generate``): it reads its body into a chat request,
    names the engine request, and writes the response from the admitted choices."""

    @property
    def id(self) -> str: ...

    def parse(self, raw: bytes) -> c.ChatCompletionRequest: ...

    async def respond(
        self, request: Request, engine: AsyncEngine, choices: list[Choice], fmt: ChunkFormat
    ) -> Response: ...


Generate = Callable[[Request, bool, ChatAPI], Awaitable[Response]]
"""``app.generate``: (request, chat, api)."""

RENAMED = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}
"""Chat request fields in errors from the chat path, and the Responses fields they came from."""


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(json.dumps(body, ensure_ascii=True), status, media_type="application/json")


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")


def tenant_of(request: Request) -> str:
    """Whose responses a request sees: its API key's (hashed; "" when the server has no keys)."""
    state: ServerState = request.app.state.server
    return state.access.cache_salt(request.headers.get("authorization"), None)


class ResponsesCall:
    """One ``POST /v1/responses`` on the chat path (a :class:`ChatAPI`)."""

    def __init__(self, store: ResponseStore, tenant: str) -> None:
        self._id = new_id("resp")
        self._store = store
        self._tenant = tenant
        self._request: ResponsesRequest | None = None
        self._conversation: list[dict[str, Any]] = []

    @property
    def id(self) -> str:
        return self._id

    def parse(self, raw: bytes) -> ResponsesChatRequest:
        request = parse_responses_request(raw)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            entry = self._store.get(self._tenant, request.previous_response_id)
            if entry is None:
                raise invalid_request(
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            history = entry.conversation
        items = [*history_items(history), *request.items()]
        self._request, self._conversation = request, stored_items(items)
        return chat_request(request, items)

    async def respond(
        self, request: Request, engine: AsyncEngine, choices: list[Choice], fmt: ChunkFormat
    ) -> Response:
        assert self._request is not None and len(choices) == 1
        settings = request.app.state.server.settings
        frame = ResponseFrame(self._id, fmt.created, fmt.model, self._request)
        if self._request.stream:
            events = response_events(choices[0], frame, fmt.tools, settings.stream_keepalive, self._keep)
            release = partial(release_choices, choices)
            return EventStreamResponse(events, release, stall_timeout=settings.client_timeout * 3)
        [(text, out, _)] = await collect(request, engine, choices)
        body = complete(frame, text, out.state, fmt.tools)
        self._keep(body)
        return json_response(body)

    def _keep(self, body: dict[str, Any]) -> None:
        if self._request is not None and self._request.store:
            self._store.put(self._tenant, self._id, body, [*self._conversation, *conversation_output(body)])


def renamed(param: str | None) -> str | None:
    """``messages[2].content`` → ``input``: a chat field named in an error, as the Responses request says."""
    head = re.match(r"[a-z_]+", param or "")
    return RENAMED.get(head.group(), param) if head is not None else param


def responses_router(generate: Generate, settings: Settings) -> APIRouter:
    """The routes, over ``generate`` (``app.generate``) and one store for the server's life."""
    store = ResponseStore(settings.responses_store_entries, settings.responses_store_bytes)
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        try:
            return await generate(request, True, ResponsesCall(store, tenant_of(request)))
        except APIError as exc:
            exc.param = renamed(exc.param)
            raise

    @router.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def retrieve_response(request: Request, response_id: str) -> Response:
        entry = store.get(tenant_of(request), response_id)
        if entry is None:
            raise not_found(response_id)
        return json_response(entry.response)

    @router.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
    async def delete_response(request: Request, response_id: str) -> Response:
        if not store.delete(tenant_of(request), response_id):
            raise not_found(response_id)
        return json_response(DeletedResponse(id=response_id, deleted=True).model_dump())

    return router
