"""Run one side of a benchmark in a fresh Python process and read back its JSON result.

Why: in a process that already holds a model, the model loaded first decoded measurably slower (~10 % per
one-token step on this project's VM, in ad-hoc runs) than one loaded after it, whatever its settings.
Benchmarks that compare two configurations of the same model (exact vs fast mode, specserve vs llama-bench)
therefore give every side a process of its own, as llama-bench itself runs in one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_json_module(module: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m module *args`` (with ``env`` added to the environment); its last line of output is the
    JSON result. Raises on a non-zero exit."""
    environment = None if env is None else os.environ | env
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, check=False, env=environment
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed (exit {done.returncode}): {done.stderr[-300:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
