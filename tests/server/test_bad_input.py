"""Malformed requests get a 4xx OpenAI error body naming the problem, never a traceback; the server lives."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .process import ServerProcess

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# (name, path, body: JSON-able object or raw bytes, status, param named in the error or None)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("invalid json", COMPLETIONS, b'{"prompt": "x",', 400, None),
    ("not an object", COMPLETIONS, b"[1, 2]", 400, None),
    ("invalid utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    ("lone surrogate", COMPLETIONS, b'{"prompt": "\\ud800"}', 400, None),
    ("missing prompt", COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    ("prompt of wrong type", COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    ("too many prompts", COMPLETIONS, {"prompt": ["a"] * 65}, 400, "prompt"),
    ("an empty prompt in a batch", COMPLETIONS, {"prompt": [[1], []]}, 400, "prompt"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("token id out of range", COMPLETIONS, {"prompt": [1, 10**6]}, 400, "prompt"),
    ("max_tokens as string", COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("temperature -1", COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature NaN", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("top_p 2", COMPLETIONS, {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("negative seed", COMPLETIONS, {"prompt": "x", "seed": -3}, 400, "seed"),
    ("stream not a bool", COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("n=0", COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n"),
    ("n=17", COMPLETIONS, {"prompt": "x", "n": 17}, 400, "n"),
    ("too many stops", COMPLETIONS, {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("penalty out of range", COMPLETIONS, {"prompt": "x", "frequency_penalty": 2.5}, 400,
     "frequency_penalty"),
    ("repetition_penalty 0", COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("logit_bias key", COMPLETIONS, {"prompt": "x", "logit_bias": {"a": 10}}, 400, "logit_bias"),
    ("logit_bias value", COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias id", COMPLETIONS, {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("logit_bias 05", COMPLETIONS, {"prompt": "x", "logit_bias": {"05": 1}}, 400, "logit_bias"),
    ("stop_token_ids id", COMPLETIONS, {"prompt": "x", "stop_token_ids": [999999], "stream": True}, 400,
     "stop_token_ids"),
    ("logprobs 21", COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("best_of 2", COMPLETIONS, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("bad speculative", COMPLETIONS, {"prompt": "x", "speculative": {"num_draft_tokens": -1}}, 400,
     "speculative.num_draft_tokens"),
    ("unknown drafter", COMPLETIONS, {"prompt": "x", "speculative": {"drafter": "magic"}}, 400,
     "speculative.drafter"),
    ("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("beyond context", COMPLETIONS, {"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content of wrong type", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("chat n=-1", CHAT, {"messages": OK_CHAT, "n": -1}, 400, "n"),
    ("top_logprobs alone", CHAT, {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("tool_choice without tools", CHAT, {"messages": OK_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("bad tool name", CHAT, {"messages": OK_CHAT, "tools": [tool("a b")]}, 400, "tools[0].function.name"),
    ("unknown named tool", CHAT, {"messages": OK_CHAT, "tools": [tool("f")],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("chat beyond context", CHAT, {"messages": OK_CHAT, "max_completion_tokens": 10**9}, 400,
     "max_completion_tokens"),
]  # fmt: skip


def post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request(server: ServerProcess, path: str, body: Any, status: int, param: str | None) -> None:
    assert_error(post(server, path, body), status, param)


def test_context_error_names_the_numbers(server: ServerProcess) -> None:
    error = assert_error(
        post(server, COMPLETIONS, {"prompt": "hello", "max_tokens": 100_000}), 400, "max_tokens"
    )
    assert "4096" in error["message"] and "100000" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_unknown_model_is_model_not_found(server: ServerProcess) -> None:
    assert assert_error(post(server, COMPLETIONS, {"model": "x", "prompt": "x"}), 404, "model")["code"] == (
        "model_not_found"
    )


def test_oversize_body_is_413(server: ServerProcess) -> None:
    body = {"prompt": "a" * 70_000, "max_tokens": 1}  # the server takes 65536 bytes
    assert_error(post(server, COMPLETIONS, body), 413)


def test_unknown_route_and_method(server: ServerProcess) -> None:
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{server.url}{COMPLETIONS}"), 405)


def test_neutral_unsupported_fields_and_unknown_fields_are_ignored(server: ServerProcess) -> None:
    body = {
        "prompt": "x", "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
        "echo": False, "best_of": 1, "logprobs": None, "some_future_field": {"a": 1},
    }  # fmt: skip
    assert post(server, COMPLETIONS, body).status_code == 200


def test_null_means_default(server: ServerProcess) -> None:
    nulls = {"temperature": None, "top_p": None, "stop": None, "n": None, "seed": None, "stream": None}
    assert post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2, **nulls}).status_code == 200
    messages = [*OK_CHAT, {"role": "assistant", "content": None}, {"role": "user", "content": "more"}]
    assert post(server, CHAT, {"messages": messages, "max_tokens": 2, **nulls}).status_code == 200
    missing = post(server, CHAT, {"messages": [{"role": "user", "content": None}]})
    assert_error(missing, 400, "messages[0].content")


def test_server_still_serves_after_bad_input(server: ServerProcess) -> None:
    for _, path, body, _, _ in CASES:
        post(server, path, body)
    response = post(server, CHAT, {"messages": OK_CHAT, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()
