#!/usr/bin/env bash
# The prefix-cache benchmark of docs/BENCHMARKS.md: chat-multiturn and shared-system-prompt against a
# specserve server (cache on; `cold` = a fresh cache_salt per request, same server) and llama.cpp's
# llama-server with its prompt cache as users run it (cache_prompt on, 4 slots, same context per slot).
# Run on an otherwise idle machine; both servers idle while the other one works (--poll 0).
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
OUT=${OUT:-docs/bench}
PORT=${PORT:-8123}
PEER_PORT=${PEER_PORT:-8124}
STOCK=${STOCK_LLAMA_BIN:-$(PYTHON=.venv/bin/python scripts/build-stock-llama.sh)}
LLAMA_SERVER=${LLAMA_SERVER:-$STOCK/llama-server}
REQUESTS=${REQUESTS:-6}

target=$($S models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
"$LLAMA_SERVER" -m "$target" --port "$PEER_PORT" -t "$(nproc)" -c 16384 -np 4 --poll 0 >/dev/null 2>&1 &
peer=$!
$S serve --port "$PORT" --log-level warning &
server=$!
trap 'kill $server $peer 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do sleep 2; done
until curl -sf "http://127.0.0.1:$PEER_PORT/health" >/dev/null; do sleep 2; done
$S bench --url "http://127.0.0.1:$PORT" --output-dir "$OUT/prefix-cache" \
  --workload chat-multiturn shared-system-prompt --requests "$REQUESTS" --max-tokens 48 \
  --peer-url "llama-server=http://127.0.0.1:$PEER_PORT"
kill $server $peer; wait 2>/dev/null || true
