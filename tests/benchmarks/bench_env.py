"""The environment of the harness tests, as tests/tools/conftest.py sets it for the tools' tests.

Not a conftest.py: tests/benchmarks/ is no package (``benchmarks`` is the repository's own package), so a
conftest here would be a second top-level ``conftest`` module beside tests/conftest.py. A test module imports
the autouse fixture instead (``from bench_env import isolated_env``), and pytest applies it to that module.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No SPECSERVE_* settings from the developer's shell; no calibration cache (in the processes the
    harnesses start too: they inherit this environment)."""
    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SPECSERVE_MODEL_DIR", str(tmp_path / "model-cache"))
    monkeypatch.setenv("SPECSERVE_CALIBRATION_CACHE", "false")
