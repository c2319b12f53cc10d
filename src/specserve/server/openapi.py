"""The OpenAPI document (``GET /openapi.json``): the real request and response bodies, every status sent.

The routes parse their bodies themselves (for OpenAI-style errors and size limits), so FastAPI alone would
describe no request body, only a 200, and a 422 this server never sends. This fills in, from the protocol
models: each body's schema, the streamed form (``text/event-stream``), the bearer-key scheme on ``/v1/*`` and
``/admin/*``, and each error status with the OpenAI error body — so generated clients and schema fuzzers
(Schemathesis) work from it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from specserve.drafters.registry import drafter_names
from specserve.server import chat_request as c
from specserve.server import protocol as p
from specserve.server import responses as r
from specserve.server.admin import SpeculationSwitch
from specserve.server.auth import KEYED_PATHS
from specserve.server.responses_api import ResponsesRequest
from specserve.server.responses_output import ResponseObject
from specserve.server.strict import StrictModel
from specserve.server.tokenize import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


STATUS_TEXT = {
    400: "Invalid request: malformed JSON, a bad or unsupported field, a prompt too long for the context",
    401: "Missing or wrong API key",
    403: "An API key on an admin endpoint, or the admin endpoints are disabled",
    404: "Unknown model, or no stored response with that id (for this API key)",
    408: "The request body did not arrive in time",
    413: "Request body too large",
    415: "The body is not application/json",
    429: "Waiting queue full, or the key's rate limit reached (Retry-After says when to retry)",
    503: "Loading, shutting down, or the engine stopped",
    504: "The request ran past the server's request timeout",
}
GENERATION_ERRORS = (400, 401, 404, 408, 413, 415, 429, 503, 504)
BODIES: dict[tuple[str, str], tuple[type[BaseModel], type[BaseModel] | None]] = {
    ("/v1/completions", "post"): (p.CompletionRequest, r.CompletionResponse),
    ("/v1/chat/completions", "post"): (c.ChatCompletionRequest, r.ChatCompletionResponse),
    ("/v1/responses", "post"): (ResponsesRequest, ResponseObject),
    ("/admin/speculation", "post"): (SpeculationSwitch, None),
    ("/tokenize", "post"): (TokenizeRequest, None),
    ("/detokenize", "post"): (DetokenizeRequest, None),
}


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` with the completed document (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}

    def ref(model: type[BaseModel], mode: str = "validation") -> dict[str, str]:
        schema = model.model_json_schema(ref_template=REF, mode=mode)  # type: ignore[arg-type]
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        return {"$ref": REF.format(model=model.__name__)}

    error = {"application/json": {"schema": ref(ErrorResponse, "serialization")}}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            responses: dict[str, Any] = op.setdefault("responses", {})
            responses.pop("422", None)
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            statuses: tuple[int, ...] = ()
            if (path, method) in BODIES:
                request, response = BODIES[path, method]
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref(request)}},
                }
                if response is not None:
                    responses["200"] = {
                        "description": "The completion; with `stream: true` server-sent events of chunks",
                        "content": {
                            "application/json": {"schema": ref(response, "serialization")},
                            # Events are `data: <chunk JSON>` lines, then `data: [DONE]`; comments keep
                            # a waiting stream alive. Not a JSON schema's business.
                            "text/event-stream": {"schema": {}},
                        },
                    }
                    statuses = GENERATION_ERRORS
                elif path.startswith("/admin/"):
                    statuses = (400, 401, 403, 408, 413, 415, 503)
                else:
                    statuses = (400, 401, 404, 408, 413, 415, 503)
            elif path.startswith("/v1/"):
                statuses = (401, 404, 429, 503) if "{" in path else (401, 429, 503)
            elif path.startswith("/admin/"):
                statuses = (401, 403, 503)
            elif path in KEYED_PATHS:  # /tokenizer_info
                statuses = (401, 503)
            elif path == "/ready":
                statuses = (503,)
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            if path.startswith(("/v1/", "/admin/")) or path in KEYED_PATHS:
                op["security"] = [{"bearer": []}]
            for status in statuses:
                responses[str(status)] = {"description": STATUS_TEXT[status], "content": error}
    # The drafters a request may name: the registered ones (a drafter the server did not load is a 400).
    drafter = {"type": "string", "enum": ["auto", "none", *drafter_names()]}
    schemas["SpeculativeRequest"]["properties"]["drafter"] = drafter
    for name in _null_is_default_models():
        if name in schemas:
            _allow_null(schemas[name])
    return doc


def _null_is_default_models() -> set[str]:
    """Request models where ``"field": null`` means the default (StrictModel and its subclasses)."""
    names, todo = set(), [StrictModel]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def _allow_null(schema: dict[str, Any]) -> None:
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or prop.get("type") == "null":
            continue
        variants = prop.get("anyOf")
        if variants is None:
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}]}
        elif not any(v.get("type") == "null" for v in variants):
            variants.append({"type": "null"})
