"""Falling back and stopping: a corrupt draft model (degraded start, or a clear exit when it is required), a
drafter that raises mid-request (plain-decoding output, counted), and SIGTERM with requests in flight."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.config import Settings
from specserve.drafters.base import Drafter
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.server.app import create_app
from support.faulty_drafter import ExplodingDrafter
from support.tiny_models import TinyModels

from .process import free_port, start_server, stop_server
from .test_lifecycle import running, wait_for

GREEDY = {"prompt": "def add(self, other):", "temperature": 0, "max_tokens": 32, "ignore_eos": True}


def corrupt_copy(source: Path, directory: Path) -> Path:
    data = source.read_bytes()
    path = directory / "corrupt-draft.gguf"
    path.write_bytes(data[: len(data) // 2])  # a truncated download
    return path


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    families = text_string_to_metric_families(text)
    return {s.name: s.value for family in families for s in family.samples if not s.labels}


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


def test_corrupt_draft_model_starts_degraded_and_serves(tiny_models: TinyModels, tmp_path: Path) -> None:
    corrupt = corrupt_copy(tiny_models.draft_close, tmp_path)
    proc = start_server(tiny_models, tmp_path, "--draft", str(corrupt), "--load-draft", "auto")
    try:
        ready = httpx.get(f"{proc.url}/ready").json()
        assert ready["degraded"] is True and ready["drafters"] == ["ngram", "suffix"]
        assert any("truncated" in reason for reason in ready["degraded_reasons"])
        metrics = scrape(proc.url)
        assert (
            metrics["specserve:spec_decode_degraded"] == 1 and metrics["specserve:spec_decode_enabled"] == 1
        )
        url = f"{proc.url}/v1/completions"
        served = text_of(httpx.post(url, json=GREEDY, timeout=30))
        plain = text_of(httpx.post(url, json={**GREEDY, "speculative": {"enabled": False}}, timeout=30))
        assert served == plain
    finally:
        assert stop_server(proc) == 0
    warnings = [json.loads(line) for line in proc.log().splitlines() if '"warning"' in line]
    assert any(w["msg"].startswith("degraded: draft model not loaded") for w in warnings)


def test_required_draft_model_that_fails_exits_with_a_clear_message(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    corrupt = corrupt_copy(tiny_models.draft_close, tmp_path)
    command = [
        sys.executable, "-m", "specserve.cli", "serve", "--target", str(tiny_models.target), "--draft",
        str(corrupt), "--load-draft", "always", "--threads", "1", "--port", str(free_port()),
        "--model-dir", str(tmp_path / "store"), "--log-format", "text",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("specserve: error: loading the models failed: the draft model is required")
    assert "load_draft=always" in last and "truncated" in last


def test_drafter_that_raises_mid_request_gives_the_plain_output(
    tiny_models: TinyModels, caplog: pytest.LogCaptureFixture
) -> None:
    target = LlamaCppRuntime(tiny_models.target, context_per_sequence=512, max_sequences=2, n_threads=1)
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter(), "exploding": ExplodingDrafter()}
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 64: 64.0}))
    options = EngineOptions(drafters=("exploding",), num_draft_tokens=4)
    engine = SpeculativeEngine(target, drafters, FixedLengthPolicy(), costs, options)
    settings = Settings(target=str(tiny_models.target), draft="none", threads=1, max_running=2).validate()
    with running(create_app(settings, engine_factory=engine)) as url:
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200)
        body = {**GREEDY, "max_tokens": 48}
        exploded = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        plain = httpx.post(f"{url}/v1/completions", json={**body, "speculative": {"enabled": False}})
        assert text_of(exploded) == text_of(plain)
        assert exploded.json()["usage"] == plain.json()["usage"]
        metrics = scrape(url)
        assert metrics["specserve:drafter_failures_total"] == 3  # then disabled
        assert (
            metrics["specserve:spec_decode_degraded"] == 1 and metrics["specserve:spec_decode_enabled"] == 0
        )
        ready = httpx.get(f"{url}/ready").json()
        assert ready["degraded_reasons"] == ["drafter exploding disabled after repeated failures"]
    assert any("drafter exploding failed" in r.getMessage() for r in caplog.records)


@pytest.fixture
def stoppable(tiny_models: TinyModels, tmp_path: Path) -> Iterator[Any]:
    proc = start_server(tiny_models, tmp_path, "--max-running", "4", "--shutdown-grace-seconds", "60")
    yield proc
    if proc.process.poll() is None:
        proc.process.kill()
        proc.process.wait()


def test_sigterm_lets_in_flight_requests_finish_then_exits_zero(stoppable: Any) -> None:
    url = stoppable.url
    body = {**GREEDY, "max_tokens": 400, "stream": True}
    started = threading.Barrier(4)
    results: list[tuple[int, str]] = []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            started.wait()
            results.append((response.status_code, "\n".join([first, *lines])))

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for thread in threads:
        thread.start()
    started.wait(timeout=30)
    stoppable.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (ready := httpx.get(f"{url}/ready")).status_code == 200:  # the drain starts on its own thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    refused = httpx.post(f"{url}/v1/completions", json=GREEDY)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining"
    for thread in threads:
        thread.join(timeout=60)
    assert stoppable.process.wait(timeout=30) == 0
    assert len(results) == 3
    for status, text in results:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events) != ""
    assert "Traceback" not in stoppable.log()
