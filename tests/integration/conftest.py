"""The real default pair behind ``specserve serve`` (one server for every test that drives it over HTTP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.process import free_port  # tests/ is on sys.path (rootdir conftest)
from specserve.models import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, ModelStore


@pytest.fixture(scope="session")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = ModelStore()
    if store.locate(CATALOG[DEFAULT_TARGET]) is None or store.locate(CATALOG[DEFAULT_DRAFT]) is None:
        pytest.skip("default models not pulled (run: specserve models pull)")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # Two threads: the clients only wait on the server while it decodes (the agents, instructor and server
    # tests took 217 s with two against 327-337 s with one, AMD Zen 3). A fixed draft length, because the cost
    # policy would rarely draft on this CPU and the test wants drafts to verify; 16, not the default 32: a
    # fixed policy makes the draft model run every round of the maximum at every step.
    flags = "--threads 2 --max-running 2 --drafter auto --load-draft always --draft-policy fixed"
    flags += " --num-draft-tokens 16"
    command = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), *flags.split()]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            assert process.poll() is None, Path(log).read_text()
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not ready in 300 s"
            time.sleep(0.5)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
