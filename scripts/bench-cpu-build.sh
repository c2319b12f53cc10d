#!/usr/bin/env bash
# docs/BENCHMARKS.md's per-build numbers ("Both CPU builds"), for one build of llama.cpp: `native` (the
# default, -march=native) or `avx2` (the portable AVX2-only build, SPECSERVE_LLAMA_ISA=avx2: on a CPU with
# AVX-512 it measures the AVX2 kernels), each beside stock llama.cpp of the same instruction set built from
# the same sources with llama.cpp's default flags (scripts/build-stock-llama.sh). Writes docs/bench/cpu-<isa>/.
# Run it on an otherwise idle machine: llama.cpp's threads lose most of their speed when another process
# holds a core.
#   scripts/bench-cpu-build.sh native && scripts/bench-cpu-build.sh avx2
# PARTS="cost engine fresh server" (the default) chooses the measurements ("paired": only the second
# fresh-process one). ROUNDS (default 4): rounds of the fresh-process runs; REQUESTS (default 8):
# requests per cell beside llama-server (the built-in workloads have 4 prompts each: 8 runs each twice).
set -euo pipefail
cd "$(dirname "$0")/.."
isa="${1:?usage: scripts/bench-cpu-build.sh native|avx2}"
S=.venv/bin/specserve
PY=.venv/bin/python  # $PY -m benchmarks.<name>: the harnesses of benchmarks/ (not in the wheel)
OUT=${OUT:-docs/bench/cpu-$isa}
PORT=${PORT:-8123}
PEER_PORT=${PEER_PORT:-8124}
PARTS=" ${PARTS:-cost engine fresh server} "
ROUNDS=${ROUNDS:-4}
REQUESTS=${REQUESTS:-8}
stock=$(SPECSERVE_LLAMA_ISA=$isa PYTHON=.venv/bin/python scripts/build-stock-llama.sh)
if [[ "$isa" == "avx2" ]]; then
  # The Python side of both wheels is the same; only the shared libraries differ, so the AVX2 wheel's are
  # unpacked beside the installed package and loaded in their place (llama-cpp-python's LLAMA_CPP_LIB_PATH).
  wheel=$(SPECSERVE_LLAMA_ISA=avx2 PYTHON=.venv/bin/python scripts/build-llama-cpp.sh)
  lib="$HOME/.cache/specserve/lib-avx2/$(basename "$(dirname "$wheel")")"
  if [[ ! -f "$lib/llama_cpp/lib/libllama.so" ]]; then
    mkdir -p "$lib"
    .venv/bin/python -m zipfile -e "$wheel" "$lib"
  fi
  export LLAMA_CPP_LIB_PATH="$lib/llama_cpp/lib"
elif [[ "$isa" != "native" ]]; then
  echo "usage: scripts/bench-cpu-build.sh native|avx2" >&2
  exit 2
fi
mkdir -p "$OUT"
{
  grep -m1 "model name" /proc/cpuinfo
  # the model name of a VM's CPU can be as bare as "AMD EPYC": family 25 is Zen 3/4, 26 Zen 5
  grep -m3 -E "^(cpu family|model|stepping)\s" /proc/cpuinfo | tr '\n' ' '; echo
  echo "build: $isa; stock: $stock; specserve libraries: ${LLAMA_CPP_LIB_PATH:-the installed wheel}"
  .venv/bin/python -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
} | tee "$OUT/machine.txt"

# 1. Cost per call size (the row-cost curve): exact, fast (--no-exact, same build) and stock llama.cpp, each a
#    process per round; then the kernels against stock in one process, call by call (precise to a few per
#    cent), with the tiled kernel's start measured here, and forced to 8 (upstream) and 32 (the build's).
if [[ "$PARTS" == *" cost "* ]]; then
  $PY -m benchmarks.exact_cost --stock-lib "$stock" --repeats 3 --output-dir "$OUT/exact-cost"
  OUT="$OUT" scripts/bench-kernels.sh "$isa" 8 64
fi
# 2. The default policy against plain decoding on the built-in engine prompts, two rounds; then the edit and
#    summary prompts again with upstream's tiled start (8 rows) in force.
if [[ "$PARTS" == *" engine "* ]]; then
  $S bench --in-process --modes plain,auto --repeats 2 --max-tokens 128 --output-dir "$OUT/engine-auto"
  GGML_CPU_TILED_MM_MIN_BATCH=8 $S bench --in-process --modes plain,auto --repeats 2 --max-tokens 128 \
    --kinds edit,summary --output-dir "$OUT/engine-auto-tiled8"
fi
# 3. A user's first request: fresh `specserve generate` processes, plain vs auto, ROUNDS rounds; then both
#    modes in one fresh process per round (order alternating), free of the drift between
#    processes.
if [[ "$PARTS" == *" fresh "* ]]; then
  $PY -m benchmarks.fresh_generate --repeats "$ROUNDS" --max-tokens 160 --output-dir "$OUT/fresh-process"
fi
if [[ "$PARTS" == *" fresh "* || "$PARTS" == *" paired "* ]]; then
  $PY -m benchmarks.fresh_generate --paired --repeats "$ROUNDS" --max-tokens 160 \
    --output-dir "$OUT/fresh-process-paired"
fi
[[ "$PARTS" == *" server "* ]] || exit 0
# 4. Side by side with stock llama-server at concurrency 1, the two servers taking turns request by request;
#    llama-server with its defaults (no draft model) but two: -c bounds its KV memory, and --poll 0 stops
#    its idle threads from spinning after each of its requests, which slowed the next request (ours) by up
#    to 3x in an earlier run. Polling only shortens the wake-up of its threads between two tokens (micro-
#    seconds against a 40 ms step).
target=$($S models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
"$stock/llama-server" -m "$target" --port "$PEER_PORT" -c 4096 --poll 0 >/dev/null 2>&1 &
peer=$!
$S serve --port "$PORT" --max-running 1 --log-level warning &
server=$!
trap 'kill $peer $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PEER_PORT/health" >/dev/null; do sleep 2; done
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do sleep 2; done
$S bench --url "http://127.0.0.1:$PORT" --output-dir "$OUT/vs-llama-server" --compare-spec \
  --peer-url "llama-server=http://127.0.0.1:$PEER_PORT" \
  --workload code-writing code-completion code-edit qa summarization creative \
  --concurrency 1 --requests "$REQUESTS" --max-tokens 96
