#!/usr/bin/env bash
# llama.cpp's flash attention on and off, end to end on the agent traces (long contexts: tool results that
# carry files), specserve and stock llama-server each both ways, at concurrency 1, in one run: writes
# $OUT/agent-c1/ (report.json, report.md) and $OUT/machine.txt.
#
#   OUT=docs/bench/flash-attention scripts/bench-flash-attention.sh
#
# Arms, taking turns wave by wave (specserve's agent bench): specserve with --flash-attn off (the CPU
# default) in modes plain and auto; a second specserve with --flash-attn on, plain (--drafter none) and
# speculating (a third server, its defaults); stock llama-server plain with -fa on (its default, auto) and
# -fa off. The per-call costs behind it: python -m benchmarks.depth_cost --flash-attention-ab.
# Run it on an otherwise idle machine: only one server works at a time, and each gets all cores.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
OUT=${OUT:-docs/bench/flash-attention}
PORT=${PORT:-8151}
MAX_TOKENS=${MAX_TOKENS:-256}
STOCK=${STOCK_LLAMA_BIN:-$(PYTHON=.venv/bin/python scripts/build-stock-llama.sh)}
threads=$(nproc)
LOGS=${LOGS:-$(mktemp -d)}

$S models pull >/dev/null
target=$($S models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
mkdir -p "$OUT"
{ lscpu | grep -E '^Model name' || true; grep -o -w -E 'avx2|avx_vnni|avx512[a-z0-9_]*|amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' '; } >"$OUT/machine.txt"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_for() { until curl -sf "$1" >/dev/null; do sleep 2; done; }

serve() {  # port flags...: a specserve server, up before the next one loads (each calibrates at load)
  local port=$1
  shift
  $S serve --port "$port" --max-running 4 --log-level warning "$@" >"$LOGS/specserve-$port.log" 2>&1 &
  pids+=($!)
  wait_for "http://127.0.0.1:$port/ready"
}
serve "$PORT" --flash-attn off
serve $((PORT + 1)) --flash-attn on --drafter none
serve $((PORT + 2)) --flash-attn on
port=$((PORT + 3))
for fa in on off; do
  # --poll 0: an idle llama-server otherwise keeps its threads spinning and slows whatever runs next.
  "$STOCK/llama-server" -m "$target" -fa "$fa" --port "$port" -t "$threads" -c 8192 -np 4 --poll 0 \
    >"$LOGS/llama-server-fa-$fa.log" 2>&1 &
  pids+=($!)
  wait_for "http://127.0.0.1:$port/health"
  port=$((port + 1))
done

$S bench --url "http://127.0.0.1:$PORT" --workload agent --agent-modes plain,auto --concurrency 1 \
  --max-tokens "$MAX_TOKENS" \
  --peer-url "specserve-fa-on-plain=http://127.0.0.1:$((PORT + 1))" \
  --peer-url "specserve-fa-on-auto=http://127.0.0.1:$((PORT + 2))" \
  --peer-url "llama-server-fa-on=http://127.0.0.1:$((PORT + 3))" \
  --peer-url "llama-server-fa-off=http://127.0.0.1:$((PORT + 4))" \
  --output-dir "$OUT/agent-c1"
