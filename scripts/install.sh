#!/usr/bin/env bash
# Create .venv and install specserve with a llama-cpp-python built for this machine (cached between runs).
# Usage: scripts/install.sh [--dev | --tools | --torch | --system-torch [--wheels DIR]]
#   --tools: with specserve bench / verify / evaluate (the tools extra); --torch: the torch runtime
#   (--backend torch; pins torch 2.13.0: on a GPU machine with another torch, install plain and add
#   safetensors + tokenizers);
#   --dev: tools, torch, Ray and test deps
#   --system-torch: on a machine whose torch is preinstalled, maybe offline: scripts/install-system-torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[[ "${1:-}" == "--system-torch" ]] && exec scripts/install-system-torch.sh "${@:2}"
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
  *) echo "usage: scripts/install.sh [--dev | --tools | --torch | --system-torch [--wheels DIR]]" >&2; exit 2 ;;
esac
.venv/bin/python -m pip install --quiet "$wheel" -e ".$extra"
if [[ "${1:-}" == "--dev" ]]; then
  # dflash, the DFlash2 reference implementation, is a test-only oracle (tests/backends/torch/
  # test_dflash2_oracle.py). Its model module needs only torch and transformers; its pinned requirements
  # (datasets, requests, tqdm==4.70.0) serve its benchmark CLI and would downgrade ours: without them.
  .venv/bin/python -m pip install --quiet --no-deps dflash==0.1.0
  # instructor (tests/integration/test_default_pair_instructor.py) caps jiter below 0.15, and every openai
  # from 3.31 on needs jiter 0.16 or later: with its requirements pip would take openai back to 3.3 and
  # break pydantic-ai and the Agents SDK. Its code runs on today's jiter; its other requirements are in dev.
  .venv/bin/python -m pip install --quiet --no-deps instructor==1.17.0
fi
echo "installed: $(.venv/bin/specserve --help >/dev/null && echo specserve) in .venv" >&2
