"""Startup and shutdown in process: /health answers while the models load, /ready says why it is not ready,
an injected engine factory is used, a failed load is reported, and shutdown closes the engine."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from specserve.config import Settings
from specserve.engine.builder import BuildReport, build_engine
from specserve.engine.engine import SpeculativeEngine
from specserve.server.app import create_app
from specserve.server.state import ServerState
from support.tiny_models import TinyModels

from .process import free_port


@contextmanager
def running(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a thread (lifespan included); yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def settings(models: TinyModels) -> Settings:
    return Settings(
        target=str(models.target), draft="none", threads=1, max_running=1, drafter="none"
    ).validate()


def test_health_while_loading_then_ready_then_closed(tiny_models: TinyModels) -> None:
    release = threading.Event()
    built: list[SpeculativeEngine] = []

    def slow_factory(s: Settings) -> tuple[SpeculativeEngine, BuildReport]:
        assert release.wait(timeout=30)
        engine, report = build_engine(s, calibrate_costs=False)
        built.append(engine)
        return engine, report

    app = create_app(settings(tiny_models), engine_factory=slow_factory)
    with running(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "loading" and ready.json()["reason"]
        early = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert early.status_code == 503 and early.headers["retry-after"]
        assert early.json()["error"]["code"] == "server_loading"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-target"

        release.set()
        deadline = time.monotonic() + 20
        while (ready := httpx.get(f"{url}/ready")).status_code != 200:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.02)
        exactness = ready.json()["exactness"]
        assert exactness["mode"] == "batch-invariant" and "bit for bit" in exactness["check"]
        done = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
    state: ServerState = app.state.server
    assert state.status == "stopped" and built


def test_failed_load_is_reported(tiny_models: TinyModels) -> None:
    def broken(_: Settings) -> SpeculativeEngine:
        raise RuntimeError("no such model file")

    app = create_app(settings(tiny_models), engine_factory=broken)
    failures: list[BaseException] = []
    state: ServerState = app.state.server
    state.on_failure = failures.append
    with running(app) as url:
        wait_for(lambda: bool(failures))
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "no such model file" in ready.json()["reason"]
        assert httpx.get(f"{url}/health").status_code == 200


def test_prebuilt_engine_is_served(tiny_models: TinyModels) -> None:
    engine, _ = build_engine(settings(tiny_models), calibrate_costs=False)
    app = create_app(settings(tiny_models), engine_factory=engine)
    with running(app) as url:
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        assert (
            httpx.post(f"{url}/v1/chat/completions", json=chat).json()["choices"][0]["finish_reason"]
            == "length"
        )


def wait_for(condition: Callable[[], bool], deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_unexpected_error_is_a_generic_500(tiny_models: TinyModels) -> None:
    engine, _ = build_engine(settings(tiny_models), calibrate_costs=False)

    def broken_tokenize(*_: object, **__: object) -> list[int]:
        raise RuntimeError("internal detail 1234")

    engine.target.tokenize = broken_tokenize  # type: ignore[method-assign]
    with running(create_app(settings(tiny_models), engine_factory=engine)) as url:
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200)
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert "1234" not in response.text and "Traceback" not in response.text
        assert httpx.get(f"{url}/health").status_code == 200


def test_cli_exits_with_an_error_when_the_target_cannot_load(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "specserve.cli", "serve", "--target", str(tmp_path / "missing.gguf"),
        "--draft", "none", "--port", str(free_port()), "--model-dir", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "specserve: error: loading the models failed" in result.stderr
