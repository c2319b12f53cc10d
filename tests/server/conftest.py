"""Real ``specserve serve`` subprocesses on tiny models, shared by the server tests.

Each server runs llama.cpp with one thread (the test client needs the other core) and is stopped with
SIGTERM at the end of the session; its log must not hold a traceback (no unexpected server error).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.tiny_models import TinyModels

from .process import ServerProcess, start_server, stop_server


@pytest.fixture(scope="session")
def server(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The main server: 2 running sequences, 4 waiting, a generous timeout, small request bodies."""
    directory = tmp_path_factory.mktemp("server")
    proc = start_server(
        tiny_models, directory,
        "--max-running", "2", "--max-waiting", "4", "--request-timeout", "30", "--max-request-bytes", "65536",
    )  # fmt: skip
    yield proc
    code = stop_server(proc)
    assert code == 0, proc.log()  # SIGTERM: a graceful stop
    assert "Traceback" not in proc.log()


@pytest.fixture(scope="session")
def limits_server(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One sequence at a time, one waiting, 0.5 s per request; plain decoding and a long context."""
    directory = tmp_path_factory.mktemp("limits-server")
    proc = start_server(
        tiny_models, directory,
        "--max-running", "1", "--max-waiting", "1", "--request-timeout", "0.5", "--ctx-size", "8192",
        "--drafter", "none",
    )  # fmt: skip
    yield proc
    code = stop_server(proc)
    assert code == 0, proc.log()  # SIGTERM: a graceful stop
    assert "Traceback" not in proc.log()
