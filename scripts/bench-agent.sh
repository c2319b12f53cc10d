#!/usr/bin/env bash
# The agent traces and the recurring built-in workloads, specserve beside stock llama-server with each of its
# own speculation modes, in one run: writes docs/bench/<name>/ (report.json, report.md).
#
#   scripts/bench-agent.sh                 # every level of LEVELS (default "1 4"), every peer mode
#   LEVELS=1 PEERS="plain ngram-mod" MAX_TOKENS=256 RECURRING=0 scripts/bench-agent.sh  # a quick look
#
# The peers: stock llama-server built from the pinned sources (scripts/build-stock-llama.sh), plain and with
# each --spec-type the pinned server offers, at its documented defaults (draft-simple with the default
# draft model, -md). Each level starts fresh peers, so no peer's n-gram pool or cache carries over from
# another level; specserve's runs are partitioned by a fresh cache_salt per (mode, level) instead
# (src/specserve/tools/loadgen/agent.py). Run it on an otherwise idle machine: every server gets all cores
# (llama.cpp's threads collapse when another process holds one), and only one of them works at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
OUT=${OUT:-docs/bench}
PORT=${PORT:-8131}
LEVELS=${LEVELS:-"1 4"}
PEERS=${PEERS:-"plain ngram-simple ngram-map-k ngram-map-k4v ngram-mod ngram-cache draft-simple"}
MAX_TOKENS=${MAX_TOKENS:-256}
STOCK=${STOCK_LLAMA_BIN:-$(PYTHON=.venv/bin/python scripts/build-stock-llama.sh)}
threads=$(nproc)
LOGS=${LOGS:-$(mktemp -d)}  # the peers' own logs (not reports: kept out of docs/)

$S models pull >/dev/null
target=$($S models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
draft=$($S models pull qwen2.5-coder-0.5b-instruct | sed 's/^[^:]*: //')
mkdir -p "$OUT"
lscpu | grep -E '^Model name|^Flags' | sed 's/^Flags: *\(.*\)$/Flags (avx*): /;' >"$OUT/agent-machine.txt" || true
grep -o -w -E 'avx2|avx_vnni|avx512[a-z0-9_]*|amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ' >>"$OUT/agent-machine.txt" || true

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_for() { until curl -sf "$1" >/dev/null; do sleep 2; done; }

start_peer() {  # name port: a fresh llama-server, the mode's own flags at their defaults
  local mode=$1 port=$2 extra=()
  case "$mode" in
    plain) ;;
    draft-simple) extra=(-md "$draft" --spec-type draft-simple) ;;
    *) extra=(--spec-type "$mode") ;;
  esac
  # --poll 0: an idle llama-server otherwise keeps its threads spinning and slows whatever runs next.
  "$STOCK/llama-server" -m "$target" "${extra[@]}" --port "$port" -t "$threads" -c 8192 -np 4 --poll 0 \
    >"$LOGS/agent-peer-$mode.log" 2>&1 &
  pids+=($!)
}

$S serve --port "$PORT" --max-running 4 --log-level warning &
pids+=($!)
wait_for "http://127.0.0.1:$PORT/ready"

best_peer() {  # the fastest speculative peer mode over all agent traces of a report
  .venv/bin/python - "$1" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))["levels"]
rows = next(iter(summary.values()))["summary"]
peers = {m: r["all"]["tokens_per_second"] or 0 for m, r in rows.items() if m.startswith("llama-server-")}
peers.pop("llama-server-plain", None)
print(max(peers, key=peers.get).removeprefix("llama-server-"))
PY
}

first=1
for level in $LEVELS; do
  peer_args=()
  recurring_args=()
  port=$((PORT + 1))
  for mode in $PEERS; do
    start_peer "$mode" "$port"
    wait_for "http://127.0.0.1:$port/health"
    peer_args+=(--peer-url "llama-server-$mode=http://127.0.0.1:$port")
    case "$mode" in
      plain | ngram-mod | ngram-cache) recurring_args+=(--peer-url "llama-server-$mode=http://127.0.0.1:$port") ;;
    esac
    port=$((port + 1))
  done
  $S bench --url "http://127.0.0.1:$PORT" --workload agent --concurrency "$level" --max-tokens "$MAX_TOKENS" \
    "${peer_args[@]}" --output-dir "$OUT/agent-c$level"
  # The built-in workloads with recurring prompts, on the same fresh peers: plain llama-server and its two
  # modes that keep n-grams across requests.
  # At the first level only (RECURRING=0: not at all): the first 2 prompts of each, each sent twice.
  if [[ -n "$first" && "${RECURRING:-1}" != 0 ]]; then
    $S bench --url "http://127.0.0.1:$PORT" --compare-spec --workload code-edit summarization qa creative \
      code-writing --limit 2 --requests 4 --concurrency "$level" --max-tokens 96 "${recurring_args[@]}" \
      --output-dir "$OUT/recurring-c$level"
  fi
  kill "${pids[@]:1}" 2>/dev/null || true
  wait "${pids[@]:1}" 2>/dev/null || true
  pids=("${pids[0]}")
  if [[ -n "$first" && -z "${KEEP_PEERS:-}" ]]; then  # later levels: plain and the best of this level
    PEERS="plain $(best_peer "$OUT/agent-c$level/report.json") ngram-mod ngram-cache"
    PEERS=$(tr ' ' '\n' <<<"$PEERS" | awk '!seen[$0]++' | tr '\n' ' ')
    first=""
  fi
done
