#!/usr/bin/env bash
# Ray Serve scale-out on this machine (docs/BENCHMARKS.md#scale-out-on-ray-serve), on an otherwise idle machine:
#   1. N engine replicas x 1 thread (N = cores) against the single process with N threads: same total threads;
#   2. 1 replica x N threads against the single process: what the Ray path costs with the engine unchanged;
#   3. Ray's overhead per request, on tiny models (so that the model's time does not hide it).
# Each is one `specserve bench --url ... --peer-url single=...` run: the two servers interleaved, wave by wave.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
OUT=${OUT:-docs/bench}
SINGLE_PORT=${SINGLE_PORT:-8131}
RAY_PORT=${RAY_PORT:-8132}
CORES=$(nproc)
SINGLE="http://127.0.0.1:$SINGLE_PORT"
RAY="http://127.0.0.1:$RAY_PORT"
pids=()
trap 'for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait' EXIT

replicas_ready() {
  curl -sf "$RAY/ready" | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["replicas_ready"])' \
    2>/dev/null || true
}
start_single() {  # model args...
  $S serve --port "$SINGLE_PORT" --threads "$CORES" --log-level warning "$@" & single=$!
  pids+=("$single")
  until curl -sf "$SINGLE/ready" >/dev/null; do sleep 2; done
}
start_ray() {  # replicas threads model args...
  local n=$1 threads=$2
  shift 2
  $S serve --replicas "$n" --threads "$threads" --port "$RAY_PORT" --log-level warning "$@" & ray=$!
  pids+=("$ray")
  until [[ "$(replicas_ready)" == "$n" ]]; do sleep 2; done
}
stop() { kill -INT "$1"; wait "$1" 2>/dev/null || true; }

$S models pull >/dev/null
BENCH=(--workload qa code-edit --concurrency 1,4 --requests 6 --max-tokens 48)

# Fresh servers for every run: both sides start with empty prefix caches (the prompts repeat across runs).
start_single
start_ray "$CORES" 1
$S bench --url "$RAY" --peer-url single="$SINGLE" "${BENCH[@]}" --output-dir "$OUT/replicas-${CORES}x1"
stop "$ray"
stop "$single"
start_single
start_ray 1 "$CORES"
$S bench --url "$RAY" --peer-url single="$SINGLE" "${BENCH[@]}" --output-dir "$OUT/replicas-1x${CORES}"
stop "$ray"
stop "$single"

# 3. Overhead per request: a tiny random model (written by the test helpers), speculation off, 8 tokens.
tiny=$(mktemp -d)
PYTHONPATH=tests .venv/bin/python -c "import sys; from pathlib import Path; from support.tiny_models import \
tiny_model_set; print(tiny_model_set(Path(sys.argv[1])).target)" "$tiny" > "$tiny/target"
MODEL=(--target "$(cat "$tiny/target")" --draft none --drafter none --model-dir "$tiny/store")
start_single "${MODEL[@]}"
start_ray 1 "$CORES" "${MODEL[@]}"
$S bench --url "$RAY" --peer-url single="$SINGLE" --workload qa --concurrency 1,8 --requests 48 \
  --max-tokens 8 --ignore-eos --output-dir "$OUT/replicas-overhead"
