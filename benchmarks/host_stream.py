"""Streamed tokens per second of a real server on a model that costs (almost) nothing, and the CPU its
threads spend per streamed token.

specserve's server and stock llama-server are started on the same GGUF with one thread and as many slots
as streams, one after the other; each gets a warm-up request, then ``streams`` concurrent greedy
``/v1/completions`` streams of ``tokens`` tokens each (end of text ignored, plain decoding). Tokens are the
usage chunk's ``completion_tokens``. CPU per thread is read from ``/proc/PID/task/TID/schedstat``
(nanoseconds) around the streams: for specserve, the event loop (the main thread) and the engine thread
(the busiest other one; llama.cpp with one thread computes on it).
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


def start(name: str, command: list[str], port: int, log: Path, ready_path: str) -> Server:
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
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


def specserve_server(model: Path, slots: int, log: Path) -> Server:
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "specserve"),
        "serve",
        "--target",
        str(model),
        "--draft",
        "none",
    ]
    command += ["--drafter", "none", "--threads", "1", "--max-running", str(slots), "--port", str(port)]
    command += ["--no-prefix-cache", "--log-level", "warning"]
    return start("specserve", command, port, log, "/ready")


def llama_server(binary: Path, model: Path, slots: int, context: int, log: Path) -> Server:
    port = free_port()
    command = [str(binary), "-m", str(model), "-t", "1", "-np", str(slots), "-c", str(context * slots)]
    command += ["--port", str(port), "--host", "127.0.0.1"]
    return start("llama-server", command, port, log, "/health")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds so far of each thread of ``pid`` by thread id (``pid`` itself: the main thread)."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except OSError:  # the thread ended
            continue
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
    if server.name == "specserve":  # Python 3.11 names no OS thread: the engine's is the busiest other one
        pid = server.process.pid
        row["event_loop_cpu_us_per_token"] = round(cpu.get(pid, 0.0), 1)
        row["engine_cpu_us_per_token"] = round(max((v for k, v in cpu.items() if k != pid), default=0.0), 1)
    return row
