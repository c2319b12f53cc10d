#!/usr/bin/env bash
# Install specserve with test dependencies, check lint and types, fetch the default model pair, run the tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not model" for the fast part only).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --dev
# Habits enforced, not configured: a ruff or mypy (strict) error in src/, tests/ or benchmarks/ fails the run.
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
.venv/bin/specserve models pull
.venv/bin/python -m pytest "$@"
