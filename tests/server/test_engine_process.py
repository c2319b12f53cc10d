"""The server with its engine core in a process of its own (the default) against the same server with the
engine on a thread, and what happens to each side when the other dies."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest

from support.tiny_models import TinyModels

from .process import ServerProcess, gone, start_server, stop_server


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    """What a client reads of a response; not the speculation counters or the prefix-cache hits, which
    depend on the server's earlier requests (its suffix drafter's and prefix cache's contents)."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {"choices": body["choices"], "usage": usage, "model": body["model"]}


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/completions",
        {"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0, "logprobs": 2, "stop": [" a"]},
    ),
    ("/v1/completions", {"prompt": "class Point:", "max_tokens": 24, "n": 2, "temperature": 0.9, "seed": 3}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 32,
            "temperature": 0,
            "speculative": {"drafter": "draft-model", "num_draft_tokens": 8},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
]


def _answer(url: str, path: str, body: dict[str, Any]) -> Any:
    if not body.get("stream"):
        response = httpx.post(url + path, json=body, timeout=60)
        assert response.status_code == 200, response.text
        return _comparable(response.json())
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    # How tokens are grouped into events depends on timing (a stream that falls behind gets several steps'
    # tokens in one event); what they add up to does not.
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    return text, finish, chunks[-1]["usage"]["completion_tokens"]


def test_the_engine_on_a_thread_answers_as_the_engine_process_does(
    server: ServerProcess, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert len(server.engine_pids()) == 1  # the session's server: the engine in its own process
    directory = tmp_path_factory.mktemp("thread-server")
    threaded = start_server(tiny_models, directory, "--max-running", "2", "--no-engine-process")
    try:
        assert threaded.engine_pids() == []
        for path, body in REQUESTS:
            assert _answer(threaded.url, path, body) == _answer(server.url, path, body), (path, body)
    finally:
        assert stop_server(threaded) == 0


def test_a_graceful_stop_ends_the_engine_process(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> None:
    proc = start_server(tiny_models, tmp_path_factory.mktemp("stopped"))
    [engine_pid] = proc.engine_pids()
    assert stop_server(proc) == 0
    assert gone(engine_pid, 1.0)  # the server waited for it
    assert "Traceback" not in proc.log()


def test_an_engine_process_that_dies_ends_streams_and_the_server_exits_nonzero(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Killed mid-stream: the stream ends with an error event (never a hang), the server stops being ready
    and exits with status 1, for its supervisor to restart it."""
    proc = start_server(tiny_models, tmp_path_factory.mktemp("engine-killed"))
    [engine_pid] = proc.engine_pids()
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 5:
                    os.kill(engine_pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_stopped", error
        assert proc.process.wait(timeout=20) == 1
        assert "the engine process stopped: the engine process exited with status -9" in proc.log()
    finally:
        if proc.process.poll() is None:
            proc.process.kill()
            proc.process.wait()


def test_the_heap_endpoint_reports_both_processes(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With tracemalloc on, GET /admin/heap gives the API process's heap and the engine process's (where the
    prefix cache's host tier lives): what the soak adds up."""
    env = {"SPECSERVE_ADMIN_KEY": "adm", "PYTHONTRACEMALLOC": "1"}
    proc = start_server(tiny_models, tmp_path_factory.mktemp("heap"), env=env)
    try:
        httpx.post(f"{proc.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
        heap = httpx.get(f"{proc.url}/admin/heap", headers={"Authorization": "Bearer adm"}, timeout=60).json()
        assert heap["tracing"] and heap["traced_bytes"] > 0 and heap["top"]
        engine = heap["engine"]
        assert engine["tracing"] and engine["traced_bytes"] > 0 and engine["top"]
        assert any("specserve/engine" in site["where"] or "llama" in site["where"] for site in engine["top"])
    finally:
        assert stop_server(proc) == 0
