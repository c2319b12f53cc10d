#!/usr/bin/env bash
# Create .venv and install specserve with a llama-cpp-python built for this machine (cached between runs).
# Usage: scripts/install.sh [--dev | --tools]
#   --tools: with specserve bench / verify / evaluate (the tools extra); --dev: tools, Ray and test deps
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
wheel=$(PYTHON=.venv/bin/python scripts/build-llama-cpp.sh)
extra=""
case "${1:-}" in
  --dev) extra="[dev]" ;;
  --tools) extra="[tools]" ;;
  "") ;;
  *) echo "usage: scripts/install.sh [--dev | --tools]" >&2; exit 2 ;;
esac
.venv/bin/python -m pip install --quiet "$wheel" -e ".$extra"
echo "installed: $(.venv/bin/specserve --help >/dev/null && echo specserve) in .venv" >&2
