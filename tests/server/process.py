"""Start, poll and stop a real ``specserve serve`` subprocess on tiny models."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from support.tiny_models import TinyModels

READY_DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_pids(self) -> list[int]:
        """The server's child processes: its engine process (none with ``--no-engine-process``)."""
        found: list[int] = []
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            found += [int(pid) for pid in (task / "children").read_text().split()]
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def state(self) -> dict[str, object]:
        response = httpx.get(f"{self.url}/v1/internal/state", timeout=5)
        response.raise_for_status()
        state: dict[str, object] = response.json()
        return state

    def wait_idle(self, deadline_s: float = 20.0) -> dict[str, object]:
        """Poll until no request runs or waits; returns the last state."""
        deadline = time.monotonic() + deadline_s
        while True:
            state = self.state()
            if state["running"] == 0 and state["waiting"] == 0:
                return state
            assert time.monotonic() < deadline, f"server still busy: {state}"
            time.sleep(0.05)


def start_server(
    models: TinyModels, directory: Path, *extra: str, env: Mapping[str, str] | None = None
) -> ServerProcess:
    """Start a server and wait until it is ready (``extra`` flags override the defaults, ``env`` adds)."""
    port = free_port()
    log_path = directory / f"server-{port}.log"
    command = [
        sys.executable, "-m", "specserve.cli", "serve",
        "--target", str(models.target), "--draft", str(models.draft_close),
        "--threads", "1", "--port", str(port), "--model-dir", str(directory / "store"),
        "--drafter", "auto", "--load-draft", "always", "--draft-p-min", "0",
        "--draft-policy", "fixed",  # the cost model never pays for a draft as big as the target
        *extra,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        environment = {**os.environ, **(env or {})}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + READY_DEADLINE_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"server not ready after {READY_DEADLINE_S} s:\n{server.log()}")
        time.sleep(0.1)


def stop_server(server: ServerProcess) -> int:
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        raise


def gone(pid: int, deadline_s: float = 10.0) -> bool:
    """Whether process ``pid`` has exited (or is a zombie) within the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False
