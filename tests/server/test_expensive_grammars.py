"""Schemas, grammars and tool lists built to be expensive are refused (a 400 naming the field) or compiled
within a bounded time, and the server goes on serving: llguidance's limits (recursion depth, grammar size,
lexer states; structured/grammar.py's parser limits) refuse what would be slow, and at most 128 tools are
accepted. docs/API.md states the times."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from .process import ServerProcess

BOUND_S = 10.0  # generous for a loaded CI machine; docs/API.md has the times measured


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _tool(i: int, params: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": params, "required": list(params)[:1]}
    return {"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters}}


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


ENUMS = {f"p{j}": {"enum": [f"v{k}" for k in range(40)]} for j in range(8)}
CASES = {
    "deep nesting": (_schema(_nested(200)), "response_format"),
    "ambiguous grammar": (
        {"structured_outputs": {"grammar": 'start: x\nx: "a" x | x "a" | "a" | x x'}},
        None,
    ),
    "huge alternation": ({"structured_outputs": {"regex": "|".join(f"w{i}" for i in range(6000))}}, None),
    "many alternatives": (_schema({"anyOf": [{"const": f"c{i}"} for i in range(3000)]}), None),
    "129 tools": ({"tools": [_tool(i, {"a": {"type": "string"}}) for i in range(129)]}, "tools"),
    "enum-heavy tools": ({"tools": [_tool(i, ENUMS) for i in range(20)], "tool_choice": "required"}, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_expensive_constraint_is_refused_or_bounded_and_the_server_goes_on(
    server: ServerProcess, name: str
) -> None:
    extra, param = CASES[name]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, **extra}
    assert len(json.dumps(body)) < 65536  # within the test server's body limit
    start = time.perf_counter()
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    elapsed = time.perf_counter() - start
    assert elapsed < BOUND_S, (name, elapsed)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if param is not None:
            assert error["param"] == param
    elif param is not None:
        pytest.fail(f"{name} was accepted: {response.text[:200]}")
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
