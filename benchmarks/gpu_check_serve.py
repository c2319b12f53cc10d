"""The GPU check's ``serve`` section: the OpenAI server around the torch runtime, against the engine alone.

What the host path costs at a GPU's step rate (issue 33): the same plain decoding of random weights, first
by the engine in a loop (its own tokens/s, on the check's runtime of the server's kernels), then through
``specserve``'s server as it is deployed (its engine in a process of its own, exact mode, graphs on a GPU)
with 1 and 8 concurrent streaming clients (``/v1/completions``, a prompt of token ids, ``ignore_eos``, the
usage chunk counted): aggregate completion tokens over wall time from the requests' start to the last
stream's end, the same for both. The engine process loads its target from a path, so the random model is
written as a checkpoint directory first (benchmarks/gpu_check_checkpoint.py); the server itself runs in
this process (uvicorn on a thread, on 127.0.0.1), so the check needs no free port but its own.

Needs the server's packages (fastapi, uvicorn, pydantic, httpx ...), which the rest of the check does not:
on the device machine ``scripts/install.sh --system-torch --wheels .whl`` first (docs/TORCH.md). Without
them the section says which is missing and is skipped, not failed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

from benchmarks.gpu_check_checkpoint import write_checkpoint
from specserve.backends.torch.model import Decoder
from specserve.backends.torch.runtime import TorchRuntime
from specserve.engine.builder import flat_costs
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.request import SamplingParams

STREAMS = (1, 8)
READY_SECONDS = 600.0
"""The engine process imports torch, loads the checkpoint, proves exact mode, captures graphs, calibrates."""


def engine_rate(runtime: TorchRuntime, streams: int, prompt: list[int], max_tokens: int) -> float:
    """Tokens/s of ``streams`` requests decoded together by the engine alone, prefill included."""
    options = EngineOptions((), 0, speculation_enabled=False)
    engine = SpeculativeEngine(runtime, {}, FixedLengthPolicy(), CostModel(flat_costs()), options)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("warm-up", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
    start = time.perf_counter()
    for i in range(streams):
        engine.add_request(f"engine-{i}", prompt, params)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def serve_section(
    runtime: TorchRuntime,
    model: Decoder,
    prompt: list[int],
    max_tokens: int,
    threads: int | None = None,
    streams: tuple[int, ...] = STREAMS,
) -> dict[str, Any]:
    """Per stream count: the engine's tokens/s (``runtime``: the kernels the server's defaults choose), the
    server's on ``model`` written to disk, and their ratio."""
    try:
        import httpx
        import uvicorn

        from specserve.config import Settings
        from specserve.server.app import create_app
    except ImportError as exc:
        missing = exc.name or str(exc)
        return {"skipped": f"no {missing}: install the server first (scripts/install.sh --system-torch)"}
    alone = {n: engine_rate(runtime, n, prompt, max_tokens) for n in streams}
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as directory:
        started = time.perf_counter()
        path = write_checkpoint(model, Path(directory))
        written = time.perf_counter() - started
        port = _free_port()
        settings = Settings(
            target=str(path), draft=None, drafter="none", backend="torch",
            device="cuda" if runtime.device.type == "cuda" else "cpu",
            dtype=cast(Any, str(runtime.dtype).removeprefix("torch.")), threads=threads, port=port,
            max_running=max(streams), context_size=runtime.info.context_per_sequence, prefix_cache=False,
            calibration_cache=False, served_model_name="gpu-check", log_level="warning",
        ).validate()  # fmt: skip
        app = create_app(settings)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_config=None, log_level="warning", access_log=False
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="gpu-check-server", daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        try:
            started = time.perf_counter()
            facts = _wait_ready(httpx, url)
            ready = time.perf_counter() - started
            served = {n: asyncio.run(_streams(httpx, url, n, prompt, max_tokens)) for n in streams}
        finally:
            server.should_exit = True
            thread.join(120)
    rows = {
        str(n): {
            "engine_tokens_per_s": round(alone[n], 2),
            "server_tokens_per_s": round(served[n], 2),
            "server_over_engine": round(served[n] / alone[n], 3) if alone[n] else None,
        }
        for n in streams
    }
    return {
        "max_tokens": max_tokens,
        "prompt_tokens": len(prompt),
        "engine_exactness": runtime.info.exactness,
        "server": facts,
        "checkpoint_write_seconds": round(written, 1),
        "server_ready_seconds": round(ready, 1),
        "streams": rows,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_ready(httpx: Any, url: str) -> dict[str, Any]:
    """/ready's answer once it is 200 (what the server says it runs: exactness, drafters, graphs)."""
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(url + "/ready", timeout=5)
            if answer.status_code == 200:
                ready: dict[str, Any] = answer.json()
                return ready
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {READY_SECONDS:.0f} s")


async def _streams(httpx: Any, url: str, streams: int, prompt: list[int], max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        await _stream(client, url, prompt, 4)  # the first request's one-off costs out of the way
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, url, prompt, max_tokens) for _ in range(streams)))
        return sum(counts) / (time.perf_counter() - start)


async def _stream(client: Any, url: str, prompt: list[int], max_tokens: int) -> int:
    body = {
        "model": "gpu-check",
        "prompt": prompt,
        "max_tokens": max_tokens,
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
    if completion != max_tokens:
        raise RuntimeError(f"a stream ended after {completion} of {max_tokens} tokens")
    return completion


def render_serve(data: dict[str, Any]) -> list[str]:
    lines = [
        "## serve\n",
        "Plain decoding through the server as deployed (engine process, streaming clients) against the "
        "engine alone on the same kernels, the same tokens.\n",
    ]
    for name, entry in data.get("serve", {}).items():
        lines.append(f"**{name}**\n")
        if "error" in entry:
            lines.append(f"failed: `{entry['error']}`\n")
            continue
        if "skipped" in entry:
            lines.append(f"skipped: {entry['skipped']}\n")
            continue
        lines += ["| streams | engine tokens/s | server tokens/s | server / engine |", "|---|---|---|---|"]
        for n, row in entry["streams"].items():
            lines.append(
                f"| {n} | {row['engine_tokens_per_s']:.1f} | {row['server_tokens_per_s']:.1f} | "
                f"{row['server_over_engine']}x |"
            )
        lines.append(
            f"\n{entry['max_tokens']} tokens a stream after {entry['prompt_tokens']} prompt tokens; engine "
            f"kernels {entry['engine_exactness']}; server ready {entry['server_ready_seconds']} s after the "
            f"checkpoint was written ({entry['checkpoint_write_seconds']} s)\n"
        )
    return lines
