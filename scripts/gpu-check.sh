#!/usr/bin/env bash
# The GPU check of the torch runtime: numbers / plain / verify / oracle / exact / attention / serve sections
# on random weights of real shapes (Qwen2.5-1.5B and Llama-3.1-8B targets, 0.5B-shaped drafts), written to
# DIR/gpu-check.{json,md}.
#
#   scripts/gpu-check.sh --output-dir DIR                          # on the device (cuda, bf16, <= budget)
#   scripts/gpu-check.sh --output-dir DIR --device cpu --tiny --threads 1   # the CPU dry run (seconds)
#   further options: --budget-seconds S (default 420), --shapes qwen2.5-1.5b, --dtype float16
#
# Runs from the repository tree: the check is benchmarks/gpu_check.py (not in the wheel; found from the
# repository root, the working directory here), and the device machine gets the tree, not an installed
# wheel, so src/ goes on PYTHONPATH unless specserve is importable already. Imports: every section but
# `serve` needs only torch and numpy besides specserve's own modules and benchmarks/gpu_check*; `serve`
# (the server as deployed, against the engine alone) needs the server's packages and is skipped, saying
# which is missing, without them. On the device machine (no network) install them first from wheels made
# here (docs/TORCH.md):
#   scripts/system-torch-wheels.sh .whl --python-version 3.12 --skip numpy ...      (here, once)
#   scripts/install.sh --system-torch --wheels .whl && PYTHON=.venv/bin/python scripts/gpu-check.sh ...
#     (there, carrying .whl)
# Exit status: 0 when every section ran, 1 when one failed (recorded in both files), 2 without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
  elif command -v python3 >/dev/null; then PY=python3
  else PY=python; fi
fi
if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("specserve.backends.torch") is None)' 2>/dev/null; then
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
GPU_CHECK_COMMAND="scripts/gpu-check.sh$(printf ' %q' "$@")"
export GPU_CHECK_COMMAND
exec "$PY" -m benchmarks.gpu_check "$@"
