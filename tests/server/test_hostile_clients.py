"""Regression tests for defects found by probing the server as a hostile or careless client (issue 10).

Each test is named after the defect it pins down: slow headers, a connection flood, cross-site plain-text
bodies, unchecked admin bodies, queued streams that went silent, an OpenAPI document without bodies.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from support.tiny_models import TinyModels

from .process import ServerProcess, gone, start_server, stop_server

ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture(scope="module")
def strict(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Tight limits: 1 s for headers and bodies, 12 connections, one running sequence, 0.2 s keep-alives."""
    proc = start_server(
        tiny_models, tmp_path_factory.mktemp("strict"), "--max-running", "1", "--max-waiting", "4",
        "--client-timeout", "1", "--max-connections", "12", "--stream-keepalive", "0.2", "--ctx-size", "8192",
        "--max-request-bytes", "100000", env={"SPECSERVE_ADMIN_KEY": "adm"},
    )  # fmt: skip
    yield proc
    assert stop_server(proc) == 0, proc.log()
    assert "Traceback" not in proc.log()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection within ``seconds`` (reads until EOF or a reset)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def test_slow_headers_are_cut_off_regression_slowloris(strict: ServerProcess) -> None:
    slow = [_connect(strict) for _ in range(5)]
    for sock in slow:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never finished
    started = time.monotonic()
    assert all(_closed_within(sock, 10) for sock in slow)
    assert time.monotonic() - started < 8  # the 1 s deadline, not a client-side timeout
    # a keep-alive connection gets the same deadline for its next request's headers
    with _connect(strict) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(sock, 10)
    assert httpx.get(f"{strict.url}/health", timeout=5).status_code == 200


def test_connections_past_the_cap_are_closed_regression_connection_flood(strict: ServerProcess) -> None:
    flood = [_connect(strict) for _ in range(30)]
    try:
        closed = sum(_closed_within(sock, 0.5) for sock in flood[12:])
        assert closed >= 15  # past max_connections (12): closed at once, before any header deadline
    finally:
        for sock in flood:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{strict.url}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_non_json_bodies_are_415_regression_cross_site_plain_text(
    strict: ServerProcess, content_type: str | None
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    response = httpx.post(f"{strict.url}/v1/completions", content=body, headers=headers, timeout=10)
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(f"{strict.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200


def test_slow_body_is_408_regression_slow_body(strict: ServerProcess) -> None:
    with _connect(strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        sock.settimeout(10)
        reply = _whole_response(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b'"code":"timeout"' in reply.replace(b" ", b"")


def _whole_response(sock: socket.socket) -> bytes:
    """Headers and the Content-Length body, however TCP splits them (a loaded machine sends two segments)."""
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _content_length(reply):
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    return reply


def _content_length(reply: bytes) -> int:
    for line in reply.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_client_gone_mid_body_is_aborted_not_an_error_regression_disconnect_during_body(
    strict: ServerProcess,
) -> None:
    # Found by the load campaign: a client abandoned while its body was still on the way made a 500 and a
    # traceback (Starlette's ClientDisconnect out of the body reader).
    def errors() -> float:
        text = httpx.get(f"{strict.url}/metrics", timeout=5).text
        line = next(x for x in text.splitlines() if x.startswith('specserve:requests_total{outcome="error"}'))
        return float(line.split()[-1])

    before = errors()
    with _connect(strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "x'
        )
        time.sleep(0.2)
    time.sleep(0.5)
    assert errors() == before
    assert "Traceback" not in strict.log()
    assert httpx.get(f"{strict.url}/health", timeout=5).status_code == 200


def test_admin_body_has_the_v1_checks_regression_admin_body(strict: ServerProcess) -> None:
    url = f"{strict.url}/admin/speculation"
    nested = b"[" * 100_000 + b"]" * 100_000
    deep = httpx.post(url, content=nested, headers={**ADMIN, "Content-Type": "application/json"}, timeout=10)
    assert deep.status_code == 413  # past max_request_bytes before any parsing
    deep = httpx.post(
        url, content=b"[" * 40_000 + b"]" * 40_000, headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert deep.status_code == 400 and "Traceback" not in deep.text
    big = httpx.post(url, content=b" " * 5_000_000, headers={**ADMIN, "Content-Type": "application/json"})
    assert big.status_code == 413
    assert httpx.post(url, json={"enabled": True}, headers=ADMIN).status_code == 200
    assert "RecursionError" not in strict.log()


def test_queued_stream_gets_keepalives_regression_queued_silence(strict: ServerProcess) -> None:
    # One running sequence: a long request holds it while a streamed one waits in the queue.
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "speculative": {"enabled": False}}
    holder = threading.Thread(
        target=httpx.post, args=(f"{strict.url}/v1/completions",), kwargs={"json": body, "timeout": 120}
    )
    holder.start()
    time.sleep(0.3)
    lines: list[str] = []
    stream = {"prompt": "y", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{strict.url}/v1/completions", json=stream, timeout=120) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data:"):
                break
    holder.join()
    assert lines and lines[0] == ": waiting"  # keep-alive comments while queued, before any data


def test_a_denormal_temperature_is_served_regression_engine_crash(strict: ServerProcess) -> None:
    # The request schema fuzzing found: it made the sampling probabilities NaN and killed the engine thread.
    body = {"prompt": "x", "max_tokens": 4, "temperature": 5e-324, "top_k": 3, "top_p": 5e-324, "seed": 1}
    assert httpx.post(f"{strict.url}/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.get(f"{strict.url}/ready", timeout=5).status_code == 200


def test_openapi_describes_bodies_and_statuses_regression_empty_openapi(strict: ServerProcess) -> None:
    doc = httpx.get(f"{strict.url}/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert schema.endswith("CompletionRequest")
        assert {"200", "400", "401", "413", "415", "429", "503", "504"} <= set(op["responses"])
        assert "422" not in op["responses"] and op["security"] == [{"bearer": []}]
    assert "cache_salt" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "speculative" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert doc["paths"]["/admin/speculation"]["post"]["requestBody"]


def test_sigkill_mid_stream_then_restart_serves_cleanly(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = tmp_path_factory.mktemp("killed")
    first = start_server(tiny_models, directory, "--max-running", "2")
    [engine_pid] = first.engine_pids()
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    ended_with_error = False
    try:
        with httpx.stream("POST", f"{first.url}/v1/completions", json=body, timeout=30) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i == 5:
                    first.process.kill()  # SIGKILL: no drain, no cleanup
    except httpx.HTTPError:
        ended_with_error = True  # the client sees a broken stream, never a hang
    assert first.process.wait(timeout=10) == -9
    assert ended_with_error
    assert gone(engine_pid), "the engine process outlived its server"  # it reads end-of-file and exits
    again = start_server(tiny_models, directory, "--max-running", "2")  # same model cache and calibration
    try:
        state = httpx.get(f"{again.url}/v1/internal/state", timeout=5).json()
        assert state["ready"] and state["running"] == 0 and state["waiting"] == 0
        done = httpx.post(f"{again.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
        assert done.status_code == 200 and done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        assert stop_server(again) == 0


def test_idle_connections_outlive_the_clients_expiry_regression_keepalive_race(server: ServerProcess) -> None:
    # uvicorn closed idle connections at 5 s, httpx's (the openai client's) own idle expiry: a request sent
    # at that moment into a connection being closed never reached the server (a transport error).
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert not _closed_within(sock, 6.0)  # client_timeout (10 s) is the idle allowance
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
