"""Streamed tokens per second of a real server on a model that costs (almost) nothing, and the CPU its
threads spend per streamed token.

specserve's server and stock llama-server are started on the same GGUF with one thread and as many slots
as streams, one after the other; each gets a warm-up request, then ``streams`` concurrent greedy
``/v1/completions`` streams of ``tokens`` tokens each (end of text ignored, plain decoding). Tokens are the
usage chunk's ``completion_tokens``. CPU per thread is read from ``/proc/PID/task/TID/schedstat``
(nanoseconds) around the streams, over the server and its child processes: for specserve, the event loop
(the API process's main thread) and the engine (the busiest thread of the engine process, or of the API
process when the engine runs on a thread there; llama.cpp with one thread computes on it).

specserve runs as ``specserve`` (the engine core in its own process, the default), ``specserve-thread``
(``--no-engine-process``) and, given a checkout's ``src`` directory, ``baseline`` (that code, run from the
same virtual environment with ``PYTHONPATH``): before and after in one run.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPT = "def fibonacci(n):\n    "


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    name: str, command: list[str], port: int, log: Path, ready_path: str, env: dict[str, str] | None = None
) -> Server:
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(name, process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}); see {log}")
        try:
            if httpx.get(server.url + ready_path, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{name} not ready in 300 s; see {log}")


def specserve_server(
    model: Path,
    slots: int,
    log: Path,
    name: str = "specserve",
    extra: tuple[str, ...] = (),
    src: Path | None = None,
) -> Server:
    """``specserve serve`` on the tiny GGUF (``src``: another checkout's package, for a before/after)."""
    port = free_port()
    command = [sys.executable, "-m", "specserve.cli", "serve", "--target", str(model), "--draft", "none"]
    command += ["--drafter", "none", "--threads", "1", "--max-running", str(slots), "--port", str(port)]
    command += ["--no-prefix-cache", "--log-level", "warning", *extra]
    env = None if src is None else {**os.environ, "PYTHONPATH": str(src)}
    return start(name, command, port, log, "/ready", env)


def llama_server(binary: Path, model: Path, slots: int, context: int, log: Path) -> Server:
    port = free_port()
    command = [str(binary), "-m", str(model), "-t", "1", "-np", str(slots), "-c", str(context * slots)]
    # -fa off: specserve's CPU default too (plain attention is faster on the tiny model for both), so the
    # two differ in what surrounds the model, which is what this measures
    command += ["--port", str(port), "--host", "127.0.0.1", "-fa", "off"]
    return start("llama-server", command, port, log, "/health")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (the engine process of a specserve server)."""
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return found


def thread_cpu_seconds(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds so far of each thread of ``pid`` and of its children, by (process, thread id)."""
    out: dict[tuple[int, int], float] = {}
    for process in (pid, *children(pid)):
        for tid in os.listdir(f"/proc/{process}/task"):
            try:
                stat = Path(f"/proc/{process}/task/{tid}/schedstat").read_text()
            except OSError:  # the thread ended
                continue
            out[(process, int(tid))] = int(stat.split()[0]) / 1e9
    return out


async def _stream(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> int:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    completion = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    completion = int(usage["completion_tokens"])
    return completion


async def _streams(url: str, model: str, streams: int, tokens: int) -> tuple[int, float]:
    async with httpx.AsyncClient(timeout=600) as client:
        await _stream(client, url, model, 8)  # warm-up: first-request costs out of the way
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, url, model, tokens) for _ in range(streams)))
        return sum(counts), time.perf_counter() - start


def measure(server: Server, model: str, streams: int, tokens: int) -> dict[str, Any]:
    """Aggregate tokens/s over ``streams`` concurrent streams, and CPU µs per token by thread."""
    before = thread_cpu_seconds(server.process.pid)
    total, seconds = asyncio.run(_streams(server.url, model, streams, tokens))
    after = thread_cpu_seconds(server.process.pid)
    if total < streams * tokens:
        raise RuntimeError(f"{server.name}: {total} tokens streamed of {streams * tokens}")
    cpu = {k: 1e6 * (after[k] - before.get(k, 0.0)) / total for k in after}
    row: dict[str, Any] = {
        "server": server.name,
        "streams": streams,
        "tokens": total,
        "tokens_per_s": round(total / seconds, 1),
        "process_cpu_us_per_token": round(sum(cpu.values()), 1),
    }
    if server.name != "llama-server":  # Python 3.11 names no OS thread: the engine's is the busiest other one
        pid = server.process.pid
        loop = (pid, pid)
        row["event_loop_cpu_us_per_token"] = round(cpu.get(loop, 0.0), 1)
        row["engine_cpu_us_per_token"] = round(max((v for k, v in cpu.items() if k != loop), default=0.0), 1)
    return row
