#!/usr/bin/env bash
# Create .venv and install specserve with a llama-cpp-python built for this machine (cached between runs).
# Usage: scripts/install.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
wheel=$(PYTHON=.venv/bin/python scripts/build-llama-cpp.sh)
extra=""
[[ "${1:-}" == "--dev" ]] && extra="[dev]"
.venv/bin/python -m pip install --quiet "$wheel" -e ".$extra"
echo "installed: $(.venv/bin/specserve --help >/dev/null && echo specserve) in .venv" >&2
