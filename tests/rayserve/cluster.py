"""A Ray Serve specserve application on tiny models, in this test process's own Ray cluster."""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from specserve.config import Settings
from support.tiny_models import TinyModels

READY_DEADLINE_S = 120.0


def tiny_settings(models: TinyModels, directory: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "target": str(models.target),
        "draft": str(models.draft_close),
        "model_dir": str(directory / "store"),
        "threads": 1,
        "drafter": "auto",
        "load_draft": "always",
        "draft_p_min": 0.0,
        "draft_policy": "fixed",  # the cost model never pays for a draft as big as the target
        "log_format": "text",
        **overrides,
    }
    return Settings(**values).validate()  # type: ignore[arg-type]


@dataclass
class RayApp:
    url: str
    settings: Settings

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def ready(self) -> dict[str, object]:
        body: dict[str, object] = httpx.get(f"{self.url}/ready", timeout=10).json()
        return body

    def wait_replicas(self, count: int, deadline_s: float = READY_DEADLINE_S) -> dict[str, object]:
        """Poll ``/ready`` until ``count`` replicas are ready; returns the last answer."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                ready = self.ready()
                if ready.get("replicas_ready") == count:
                    return ready
            except httpx.TransportError:
                ready = {}
            assert time.monotonic() < deadline, f"not {count} replicas ready: {ready}"
            time.sleep(0.25)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def replica_pids() -> dict[str, int]:
    """Engine replica id -> process id, from Ray's actor table."""
    from ray._private import state

    pids = {}
    for actor in state.actors().values():
        name = actor.get("Name") or ""
        if "#SpecserveEngine#" in name and actor.get("State") == "ALIVE":
            pids[name.rsplit("#", 1)[1]] = int(actor["Pid"])
    return pids


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
