"""Admission, timeouts and disconnects: each ends the request cleanly, frees its sequence, and the server
keeps serving. Long requests use large max_tokens: the tiny models rarely emit EOS (``ignore_eos`` too)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .process import ServerProcess

LONG = {"prompt": "def add(self, other):", "max_tokens": 8000, "temperature": 0, "ignore_eos": True}


def finished(server: ServerProcess, reason: str) -> int:
    counts: Any = server.state()["finished"]
    return int(counts[reason])


def wait_aborted(server: ServerProcess, before: int, deadline_s: float = 20.0) -> None:
    """Poll until the abort is counted and nothing runs (the generation alone would take far longer)."""
    deadline = time.monotonic() + deadline_s
    while True:
        state = server.state()
        if state["running"] == 0 and finished(server, "abort") == before + 1:
            return
        assert time.monotonic() < deadline, f"not aborted: {state}"
        time.sleep(0.05)


def test_queue_full_is_429_with_retry_after(limits_server: ServerProcess) -> None:
    """1 running + 1 waiting fit; of 4 simultaneous long streams at least one is refused at once."""
    barrier = threading.Barrier(4)

    def stream() -> tuple[int, dict[str, str], str]:
        barrier.wait()
        with httpx.stream(
            "POST", f"{limits_server.url}/v1/completions", json={**LONG, "stream": True}, timeout=30
        ) as response:
            return response.status_code, dict(response.headers), response.read().decode()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: stream(), range(4)))
    refused = [r for r in results if r[0] == 429]
    assert refused and any(r[0] == 200 for r in results), [r[0] for r in results]
    for _, headers, body in refused:
        assert int(headers["retry-after"]) >= 1
        error = json.loads(body)["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    limits_server.wait_idle()


def test_timeout_non_streamed_is_504(limits_server: ServerProcess) -> None:
    response = httpx.post(f"{limits_server.url}/v1/completions", json=LONG, timeout=30)
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    limits_server.wait_idle()
    ok = httpx.post(f"{limits_server.url}/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_n_choices_time_out_together_as_one_504(limits_server: ServerProcess) -> None:
    """n = 2 on a server with one slot: a choice's timeout ends the request with a 504 (not a 500), the
    other choice is aborted with it, and the server serves the next request."""
    response = httpx.post(f"{limits_server.url}/v1/completions", json={**LONG, "n": 2}, timeout=30)
    assert response.status_code == 504, response.text
    deadline = time.monotonic() + 10
    while limits_server.state()["running"] or limits_server.state()["waiting"]:
        assert time.monotonic() < deadline, limits_server.state()
        time.sleep(0.05)
    ok = httpx.post(f"{limits_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_timeout_streamed_ends_with_error_event_then_done(limits_server: ServerProcess) -> None:
    with httpx.stream(
        "POST", f"{limits_server.url}/v1/chat/completions", timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000, "stream": True},
    ) as response:  # fmt: skip
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert "Traceback" not in "".join(events)
    limits_server.wait_idle()


def test_stream_disconnect_aborts_the_sequence(server: ServerProcess) -> None:
    server.wait_idle()
    before = finished(server, "abort")
    body = {**LONG, "max_tokens": 4000, "stream": True, "speculative": {"enabled": False}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        received: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                received.append(line)
            if len(received) == 2:
                break
    assert len(received) == 2
    wait_aborted(server, before)


def test_non_streamed_disconnect_aborts_the_sequence(server: ServerProcess) -> None:
    server.wait_idle()
    before = finished(server, "abort")
    body = {**LONG, "max_tokens": 4000, "speculative": {"enabled": False}}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("the long request should not have finished in 0.3 s")
    wait_aborted(server, before)
    assert httpx.get(f"{server.url}/health").status_code == 200
