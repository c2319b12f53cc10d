"""Run the ``specserve`` CLI in-process in tests (``tests/`` is on sys.path through the rootdir conftest)."""

from __future__ import annotations

from typing import Any

import pytest

from specserve.cli import main


def run_cli(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``specserve`` in-process; returns (exit status, stdout, stderr), C-level output included."""
    try:
        code: Any = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    captured = capfd.readouterr()
    return int(code or 0), captured.out, captured.err
