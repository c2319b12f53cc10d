#!/usr/bin/env bash
# Install specserve with test dependencies, fetch the default model pair, run the test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not model" for the fast part only).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
.venv/bin/specserve models pull
.venv/bin/python -m pytest "$@"
