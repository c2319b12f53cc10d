#!/usr/bin/env bash
# Reproduce docs/BENCHMARKS.md's numbers on the default pair (run on an otherwise idle machine: llama.cpp's
# threads lose most of their speed when another process holds a core). Writes docs/bench/<name>/.
# The peers are llama.cpp's own llama-bench and llama-server, built unpatched from the same sources with
# llama.cpp's default flags by scripts/build-stock-llama.sh (STOCK_LLAMA_BIN=dir to use other binaries).
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specserve
PY=.venv/bin/python  # $PY -m benchmarks.<name>: the harnesses of benchmarks/ (not in the wheel)
OUT=${OUT:-docs/bench}
PORT=${PORT:-8123}
PEER_PORT=${PEER_PORT:-8124}
STOCK=${STOCK_LLAMA_BIN:-$(PYTHON=.venv/bin/python scripts/build-stock-llama.sh)}
LLAMA_SERVER=${LLAMA_SERVER:-$STOCK/llama-server}

$S models pull

# 1. Exact mode cost: target decode calls, exact vs --no-exact, 7 interleaved rounds (single rounds move by
#    a few per cent).
$PY -m benchmarks.exact_cost --repeats 7 --output-dir "$OUT/exact-cost"

# 1b. Plain decoding (prompt processing and one-token steps) against llama.cpp's llama-bench, 5 rounds,
#     every side a fresh process.
$PY -m benchmarks.llama_bench --vs-llama-bench "$STOCK/llama-bench" --repeats 5 \
  --output-dir "$OUT/llama-bench"

# 2. Engine, exact mode (the default): plain vs n-gram (fixed k) vs draft model (fixed k) vs the default policy.
$S bench --in-process --output-dir "$OUT/engine-exact" --max-tokens 128

# 2b. The default policy against plain decoding only, two rounds in alternating order: is it ever slower?
$S bench --in-process --modes plain,auto --repeats 2 --output-dir "$OUT/engine-auto" --max-tokens 96

# 3. Engine, fast mode (--no-exact): repacked weights allow longer verify batches.
$S bench --in-process --no-exact --modes plain,ngram,auto --output-dir "$OUT/engine-fast" --max-tokens 128

# 2c. Structured outputs: schema-constrained chat (4 schemas), plain vs grammar-forced drafts only vs the
#     default policy, two rounds; then the grammar engine's own cost per token (llguidance; xgrammar beside
#     it when installed).
$S bench --in-process --structured --modes plain,grammar,auto --max-tokens 256 --threads 2 --repeats 2 \
  --output-dir "$OUT/structured"
$PY -m benchmarks.grammar_cost --output-dir "$OUT/grammar-cost"

# 3b. evaluate: acceptance per drafter and draft length per built-in workload, expected speed-up, advice.
$S evaluate --limit 1 --draft-lengths 2,4,8,16 --max-tokens 64 --output-dir "$OUT/evaluate"

# 3c. verify: greedy equality and a sampled distribution check with the draft model drafting every step.
$S verify --in-process --limit 1 --max-tokens 48 --seeds 20 --drafter draft-model --num-draft-tokens 6 \
  --output-dir "$OUT/verify"

# 4. Server: speculation on vs off at 1, 2, 4, 8 concurrent clients (the server gets one thread per core
#    it owns; the load generator is light).
$S serve --port "$PORT" --max-running 8 --max-waiting 64 --log-level warning &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do sleep 2; done
$S bench --url "http://127.0.0.1:$PORT" --output-dir "$OUT/server" --compare-spec \
  --workload code-edit qa --concurrency 1,2,4,8 --requests 8 --max-tokens 48
kill $server; wait $server 2>/dev/null || true

# 5. Peer: llama.cpp's llama-server with the same pair (-md), same prompts and settings, one client.
if [[ -n "${LLAMA_SERVER:-}" ]]; then
  target=$($S models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
  draft=$($S models pull qwen2.5-coder-0.5b-instruct | sed 's/^[^:]*: //')
  # --poll 0: an idle llama-server otherwise keeps its threads spinning and slows whatever runs next.
  "$LLAMA_SERVER" -m "$target" -md "$draft" --port "$PEER_PORT" -t "$(nproc)" -c 4096 --poll 0 \
    >/dev/null 2>&1 &
  peer=$!
  until curl -sf "http://127.0.0.1:$PEER_PORT/health" >/dev/null; do sleep 2; done
  $S serve --port "$PORT" --max-running 1 --log-level warning &
  server=$!
  until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do sleep 2; done
  $S bench --url "http://127.0.0.1:$PORT" --output-dir "$OUT/peer" --compare-spec \
    --peer-url "llama-server-md=http://127.0.0.1:$PEER_PORT" \
    --workload code-edit qa creative --concurrency 1 --requests 3 --max-tokens 96
  kill $peer; wait $peer 2>/dev/null || true
  # The same without the draft model: llama.cpp's plain decoding.
  "$LLAMA_SERVER" -m "$target" --port "$PEER_PORT" -t "$(nproc)" -c 4096 --poll 0 >/dev/null 2>&1 &
  peer=$!
  until curl -sf "http://127.0.0.1:$PEER_PORT/health" >/dev/null; do sleep 2; done
  $S bench --url "http://127.0.0.1:$PORT" --output-dir "$OUT/peer-plain" --compare-spec \
    --peer-url "llama-server=http://127.0.0.1:$PEER_PORT" \
    --workload qa creative --concurrency 1 --requests 3 --max-tokens 96
  kill $server $peer; wait 2>/dev/null || true
fi

# 6. Prefix cache: multi-turn chats and a shared system prompt, cache vs cold vs llama-server's cache.
STOCK_LLAMA_BIN="$STOCK" LLAMA_SERVER="$LLAMA_SERVER" OUT="$OUT" PORT="$PORT" PEER_PORT="$PEER_PORT"   scripts/bench-prefix-cache.sh


# 7. DFlash2 (torch runtime): train a drafter for the default target (about an hour here), then the
#    acceptance per workload at block sizes 4, 8 and 16 beside prompt lookup, and the draft model on the
#    same runtime. Set DFLASH2_DIR to reuse a trained drafter.
if [[ -n "${WITH_DFLASH2:-}" ]]; then
  dflash="${DFLASH2_DIR:-$OUT/dflash2-drafter}"
  if [[ ! -f "$dflash/config.json" ]]; then
    .venv/bin/python scripts/drafter-prompts.py "$OUT/drafter-prompts.jsonl" --count 240 --max-lines 20
    $S train-drafter --prompts "$OUT/drafter-prompts.jsonl" --output-dir "$dflash" --steps 1400 \
      --time-limit 2400 --block-size 16 --max-new-tokens 96
  fi
  $S bench --in-process --backend torch --draft "$dflash" --output-dir "$OUT/dflash2" --max-tokens 64 \
    --modes plain,ngram,dflash2@4,dflash2@8,dflash2@16,auto
  $S bench --in-process --backend torch --output-dir "$OUT/dflash2-draft-model" --max-tokens 64 \
    --modes plain,draft-model --num-draft-tokens 15
fi
