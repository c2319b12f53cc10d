"""Run one side of a benchmark in a fresh Python process and read back its JSON result.

Why: in a process that already holds a model, the model loaded first decoded measurably slower (~10 % per
one-token step on this project's VM, in ad-hoc runs) than one loaded after it, whatever its settings.
Benchmarks that compare two configurations of the same model (exact vs fast mode, specserve vs llama-bench)
therefore give every side a process of its own, as llama-bench itself runs in one.

A module of this package (``benchmarks.…``) runs with the repository root on the child's ``PYTHONPATH``, so
that it is found whatever the working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the directory that holds this package."""


def run_json_module(module: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m module *args`` (with ``env`` added to the environment); its last line of output is the
    JSON result. Raises on a non-zero exit."""
    environment = None if env is None else os.environ | env
    if module.startswith("benchmarks."):  # importable from any working directory
        environment = os.environ.copy() if environment is None else environment
        paths = environment.get("PYTHONPATH")
        environment["PYTHONPATH"] = str(ROOT) + (os.pathsep + paths if paths else "")
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, check=False, env=environment
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed (exit {done.returncode}): {done.stderr[-300:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
