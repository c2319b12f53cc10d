#!/usr/bin/env bash
# Create .venv and install specserve with a llama-cpp-python built for this machine (cached between runs).
# Usage: scripts/install.sh [--dev | --tools | --torch]
#   --tools: with specserve bench / verify / evaluate (the tools extra); --torch: the torch runtime
#   (--backend torch; pins torch 2.13.0: on a GPU machine with another torch, install plain and add
#   safetensors + tokenizers);
#   --dev: tools, torch, Ray and test deps
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
  --torch) extra="[torch]" ;;
  "") ;;
  *) echo "usage: scripts/install.sh [--dev | --tools | --torch]" >&2; exit 2 ;;
esac
.venv/bin/python -m pip install --quiet "$wheel" -e ".$extra"
echo "installed: $(.venv/bin/specserve --help >/dev/null && echo specserve) in .venv" >&2
