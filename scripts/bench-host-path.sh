#!/usr/bin/env bash
# docs/BENCHMARKS.md's host-path numbers (issue 33): what the server costs around the model, then the default
# pair beside stock llama-server. Writes $OUT/tiny/ and $OUT/default-pair/. Run on an otherwise idle machine.
#   1. tiny: python -m benchmarks.host_overhead: µs per engine step by phase on a model that costs nothing
#      (a null runtime and the tests' 2-layer GGUF), and streamed tokens/s at 1 and 8 streams of specserve
#      (engine in its own process, and on a thread) beside stock llama-server on the same GGUF, alternating,
#      the median of REPEATS rounds. BASELINE_SRC=<another checkout>/src streams that code too, as
#      `baseline`: before and after in one run.
#   2. default-pair: `specserve serve --max-running 8` (defaults otherwise: speculation `auto`, exact mode)
#      and stock `llama-server -np 8` (its defaults, 4096 tokens of context per slot, --poll 0) on the default
#      target, `specserve bench --url … --compare-spec --peer-url llama-server=…` at concurrency 1, 4 and 8:
#      the three arms (ours `on`, ours `off`, llama-server) take turns wave by wave.
# PARTS="tiny default-pair" (the default) chooses; REQUESTS (default 8) requests per cell.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
PY=.venv/bin/python
OUT=${OUT:-docs/bench/host-path}
PORT=${PORT:-8123}
PEER_PORT=${PEER_PORT:-8124}
PARTS=" ${PARTS:-tiny default-pair} "
REQUESTS=${REQUESTS:-8}
REPEATS=${REPEATS:-7}
stock=$(PYTHON=$PY scripts/build-stock-llama.sh)
mkdir -p "$OUT"
{
  grep -m1 "model name" /proc/cpuinfo
  grep -m3 -E "^(cpu family|model|stepping)\s" /proc/cpuinfo | tr '\n' ' '; echo
  echo "cores: $(nproc); stock: $stock; git: $(git rev-parse --short HEAD)"
} | tee "$OUT/machine.txt"

if [[ "$PARTS" == *" tiny "* ]]; then
  $PY -m benchmarks.host_overhead --llama-server "$stock/llama-server" --thread-mode \
    ${BASELINE_SRC:+--baseline-src "$BASELINE_SRC"} --repeats "$REPEATS" --output-dir "$OUT/tiny"
fi

[[ "$PARTS" == *" default-pair "* ]] || exit 0
target=$($S models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
"$stock/llama-server" -m "$target" --port "$PEER_PORT" -np 8 -c 32768 --poll 0 >/dev/null 2>&1 &
peer=$!
server=""
trap 'kill $peer $server 2>/dev/null || true' EXIT
# One after the other: specserve measures (or probes) its cost table while it loads, and a llama-server
# loading beside it would skew what it measures.
until curl -sf "http://127.0.0.1:$PEER_PORT/health" >/dev/null; do sleep 2; done
$S serve --port "$PORT" --max-running 8 --log-level warning &
server=$!
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do sleep 2; done
$S bench --url "http://127.0.0.1:$PORT" --output-dir "$OUT/default-pair" --compare-spec \
  --peer-url "llama-server=http://127.0.0.1:$PEER_PORT" \
  --workload code-writing qa creative code-edit --concurrency 1,4,8 --requests "$REQUESTS" --max-tokens 96
