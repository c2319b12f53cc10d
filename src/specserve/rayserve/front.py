"""The front deployment: the one HTTP entry point, handing each request to an engine replica.

The front checks what it can without a model — access (API keys, rate limits), body size, content type and
the request's schema, with the server's own code — tokenizes the prompt with the target's vocabulary alone to
compute its prefix-cache block hashes, and passes the request to the engine deployment, whose router picks the
replica (:mod:`specserve.rayserve.router`). How the response comes back, a replica's failure included, is
:mod:`specserve.rayserve.relay`. ``/ready`` counts ready replicas, ``/metrics`` gathers every replica's
metrics labelled ``replica``, and ``POST /admin/speculation`` reaches every replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.backends.llama_cpp_vocab import LlamaCppVocabulary
from specserve.chat import chat_prompt_ids
from specserve.config import Settings
from specserve.engine.prefix_cache import block_hashes, routing_key
from specserve.models import ModelStore, ModelStoreError
from specserve.rayserve import ROUTERS
from specserve.rayserve.asgi_bridge import HTTPCall
from specserve.rayserve.metrics_merge import FrontMetrics, merge_expositions
from specserve.rayserve.relay import incoming_call, relay
from specserve.server import chat_request as c
from specserve.server import protocol as p
from specserve.server.auth import AccessControl
from specserve.server.errors import APIError, install_handlers, unavailable
from specserve.server.request_body import read_body

log = logging.getLogger("specserve.rayserve")

GENERATION = frozenset({"/v1/completions", "/v1/chat/completions"})
PIN_TIMEOUT_S = 30.0
STATUS_TTL_S = 2.0


def replica_ids() -> list[str]:
    """The engine replicas this process's router knows to be running."""
    return sorted({rid.unique_id for router in ROUTERS for rid in router.curr_replicas})


@dataclass
class ReplicaCounts:
    ready: int
    desired: int


class Front:
    """What the front's routes share (set on ``app.state.front``)."""

    def __init__(self, settings: Settings, replicas: Any, deployment_name: str, desired: int) -> None:
        self.settings = settings
        self.replicas = replicas.options(stream=True)
        """Serve's handle to the engine deployment: a call goes to the replica its router picks."""
        self.deployment_name = deployment_name
        self.access = AccessControl(settings)
        self.vocab: LlamaCppVocabulary | None = None
        self.routing = "prefix-affinity"
        store = ModelStore(None if settings.model_dir is None else Path(settings.model_dir))
        local = local_model(store, settings.target)
        if local is not None:
            self.vocab = LlamaCppVocabulary(local)
        else:  # never pull a model here just for its vocabulary: route without affinity, and say so
            self.routing = f"power-of-two choices (no {settings.target} on the front's node to tokenize with)"
            log.warning("prefix-affinity routing is off: %s", self.routing)
        self.metrics = FrontMetrics()
        self._desired = desired
        self._counts = ReplicaCounts(0, desired)
        self._counted_at = 0.0

    # -- routing key ------------------------------------------------------------------------------

    def routing_hashes(self, path: str, raw: bytes, authorization: str | None) -> list[int]:
        """The prompt's block hashes (the replica's prefix cache computes the same); validates the body."""
        req: p.CompletionRequest | c.ChatCompletionRequest
        if path == "/v1/chat/completions":
            req = p.parse_request(raw, c.ChatCompletionRequest)
        else:
            req = p.parse_request(raw, p.CompletionRequest)
        if self.vocab is None:
            return []
        if isinstance(req, c.ChatCompletionRequest):
            ids = chat_prompt_ids(self.vocab, req.chat_messages(), req.template_tools())
        else:
            first = req.prompt[0]  # a batch of prompts goes where its first one's prefix is
            ids = self.vocab.tokenize(first) if isinstance(first, str) else list(first)
        salt = self.access.cache_salt(authorization, req.cache_salt)
        return [routing_key(h) for h in block_hashes(ids, salt)]

    # -- replicas ---------------------------------------------------------------------------------

    async def counts(self) -> ReplicaCounts:
        """Ready replicas (running, as the router sees them) and the number Serve is aiming for."""
        now = time.monotonic()
        if now - self._counted_at > STATUS_TTL_S:
            self._counted_at = now
            desired = await asyncio.to_thread(self._desired_from_serve)
            self._counts = ReplicaCounts(len(replica_ids()), desired)
        return self._counts

    def _desired_from_serve(self) -> int:
        from ray import serve

        try:
            application = serve.status().applications.get(serve.get_replica_context().app_name)
            deployment = application.deployments.get(self.deployment_name) if application else None
            if deployment is not None:
                gone = ("STOPPING", "STOPPED")
                return sum(n for state, n in deployment.replica_states.items() if state not in gone)
        except Exception as exc:  # the controller is busy or restarting: keep the configured figure
            log.debug("serve.status() failed: %s", exc)
        return self._desired

    async def each_replica(
        self, request: Request, body: bytes
    ) -> list[tuple[str, tuple[int, bytes] | Exception]]:
        """``request`` (with ``body``) run on every running replica: (replica, (status, body) or the
        exception it raised).

        One replica after another, never gathered: handle calls made while serving one request share that
        request's internal id, and Serve's router matches pending requests by that id, so two at once
        collide and one is never routed (seen as a 30 s hang of ``/metrics``)."""
        answers: list[tuple[str, tuple[int, bytes] | Exception]] = []
        for replica in replica_ids():
            try:
                answers.append(
                    (replica, await self.pinned(replica, incoming_call(request, body, uuid.uuid4().hex)))
                )
            except Exception as exc:
                answers.append((replica, exc))
        return answers

    async def pinned(self, replica: str, call: HTTPCall) -> tuple[int, bytes]:
        """Run ``call`` on one given replica; (status, body)."""
        call.pin = replica
        status, chunks = 0, []

        async def run() -> None:
            nonlocal status
            async for part in self.replicas.handle.remote(call):
                if part.start:
                    status = part.status
                else:
                    chunks.append(part.body)

        await asyncio.wait_for(run(), PIN_TIMEOUT_S)
        return status, b"".join(chunks)


def local_model(store: ModelStore, target: str) -> Path | None:
    """The target's file if this node has it; never pulls (resolve would, for a catalog name)."""
    spec = store.catalog.get(target)
    if spec is not None:
        return store.locate(spec)
    try:
        return store.resolve(target, progress=False)
    except ModelStoreError:
        return None


class AccessMiddleware:
    """API keys, admin key and rate limits, checked before anything reaches a replica (pure ASGI: streams
    pass through untouched)."""

    def __init__(self, app: ASGIApp, access: AccessControl) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            client = request.client.host if request.client is not None else ""
            error = self.access.check(request.url.path, request.headers.get("authorization"), client)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_front_app(front: Front) -> FastAPI:
    app = FastAPI(title="specserve (Ray Serve front)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    install_handlers(app)

    app.add_middleware(AccessMiddleware, access=front.access)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        counts = await front.counts()
        body = {
            "status": "ready" if counts.ready else "unavailable",
            "replicas_ready": counts.ready,
            "replicas_desired": counts.desired,
            "replicas": replica_ids(),
            "routing": front.routing,
        }
        return JSONResponse(body, status_code=200 if counts.ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        counts = await front.counts()
        front.metrics.set_replicas(counts.ready, counts.desired)
        per_replica: dict[str, bytes] = {}
        for replica, answer in await front.each_replica(request, b""):
            if isinstance(answer, Exception):  # a replica going away while scraped: the others report
                log.warning("metrics of replica %s: %s", replica, answer)
            elif answer[0] == 200:
                per_replica[replica] = answer[1]
        text, content_type = merge_expositions(front.metrics.render(), per_replica)
        return Response(text, media_type=content_type)

    @app.post("/admin/speculation")
    async def speculation(request: Request) -> Response:
        raw = await read_body(request, front.settings.max_request_bytes, front.settings.client_timeout)
        results: dict[str, Any] = {}
        for replica, answer in await front.each_replica(request, raw):
            if isinstance(answer, Exception):  # that replica did not answer in time (or went away)
                log.warning("speculation switch on replica %s: %r", replica, answer)
                error = APIError(504, f"Replica {replica} did not answer: {answer!r}", "server_error")
                results[replica] = {"status": 504, "response": error.body()}
            else:
                results[replica] = {"status": answer[0], "response": json.loads(answer[1] or b"null")}
        if not results:
            raise unavailable("No engine replica is ready.", "no_replicas")
        statuses = {r["status"] for r in results.values()}
        return JSONResponse({"replicas": results}, status_code=max(statuses))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(request: Request, path: str) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        if request.url.path in GENERATION and request.method == "POST":
            settings = front.settings
            raw = await read_body(request, settings.max_request_bytes, settings.client_timeout)
            call = incoming_call(request, raw, request_id)
            try:
                call.block_hashes = front.routing_hashes(
                    request.url.path, raw, request.headers.get("authorization")
                )
            except APIError:
                raise
            except Exception as exc:  # routing is best effort; the replica's own checks answer the request
                log.debug("no routing key: %s", exc)
        else:
            call = incoming_call(request, await request.body(), request_id)
        return await relay(front.replicas, call, front.metrics)

    return app
