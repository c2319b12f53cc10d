"""Fixtures of the benchmark tool tests: an isolated environment, a live tiny server, the CLI in-process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.process import ServerProcess, start_server, stop_server  # tests/ is on sys.path (rootdir)
from support.tiny_models import TinyModels


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No SPECSERVE_* settings from the developer's shell; no calibration cache."""
    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SPECSERVE_MODEL_DIR", str(tmp_path / "model-cache"))
    monkeypatch.setenv("SPECSERVE_CALIBRATION_CACHE", "false")


@pytest.fixture(scope="module")
def bench_server(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A specserve server on the tiny pair: two running sequences, fixed-length drafting (always drafts)."""
    proc = start_server(tiny_models, tmp_path_factory.mktemp("bench-server"), "--max-running", "2")
    yield proc
    code = stop_server(proc)
    assert code in (0, -signal.SIGTERM), proc.log()
    assert "Traceback" not in proc.log()
