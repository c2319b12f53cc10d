#!/usr/bin/env bash
# The reliability campaign of docs/RELIABILITY.md: schema fuzzing (long profile, tiny models, API keys and
# the admin endpoint on), then the misbehaving-clients load on the default pair (64 clients, 10 minutes).
# Writes docs/reliability/*.json (logs: *.log, not committed). Run on an otherwise idle machine (~12 minutes).
# The soak is separate: .venv/bin/python -m benchmarks.soak (an hour).
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
OUT=${OUT:-docs/reliability}
PORT=${PORT:-8125}
DURATION=${DURATION:-600}
mkdir -p "$OUT"

# 0. Schema fuzzing, long profile (tiny models, API keys and the admin key on; ~3 minutes).
.venv/bin/python -m pytest -q -m slow tests/server/test_fuzz.py

# 1. Load with misbehaving clients: the real pair, the default limits (4 running, 64 waiting).
$S serve --port "$PORT" --log-level warning --log-format json >"$OUT/load-server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do sleep 2; done
rss_start=$(ps -o rss= -p "$server")
.venv/bin/python -m benchmarks.load --url "http://127.0.0.1:$PORT" --clients 64 \
  --duration "$DURATION" --output "$OUT/load.json" || status=$?
rss_end=$(ps -o rss= -p "$server")
echo "{\"rss_kib_start\": $rss_start, \"rss_kib_end\": $rss_end}" > "$OUT/load-memory.json"
kill -TERM $server; wait $server; echo "server exit status after SIGTERM: $?" >> "$OUT/load-memory.json"
trap - EXIT
grep -c Traceback "$OUT/load-server.log" > "$OUT/load-tracebacks.txt" || true  # the log itself is not kept
exit "${status:-0}"
