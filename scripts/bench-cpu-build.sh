#!/usr/bin/env bash
# docs/BENCHMARKS.md's per-build numbers ("Both CPU builds"), for one build of llama.cpp: `native` (the
# default, -march=native) or `avx2` (the portable AVX2-only build, SPECSERVE_LLAMA_ISA=avx2: on a CPU with
# AVX-512 it measures the AVX2 kernels), each beside stock llama.cpp of the same instruction set built from
# the same sources with llama.cpp's default flags (scripts/build-stock-llama.sh). Writes docs/bench/cpu-<isa>/.
# Run it on an otherwise idle machine: llama.cpp's threads lose most of their speed when another process
# holds a core.
#   scripts/bench-cpu-build.sh native && scripts/bench-cpu-build.sh avx2
# PARTS="cost engine fresh server" (the default) chooses the measurements.
set -euo pipefail
cd "$(dirname "$0")/.."
isa="${1:?usage: scripts/bench-cpu-build.sh native|avx2}"
S=.venv/bin/specserve
OUT=${OUT:-docs/bench/cpu-$isa}
PORT=${PORT:-8123}
PEER_PORT=${PEER_PORT:-8124}
PARTS=" ${PARTS:-cost engine fresh server} "
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
  echo "build: $isa; stock: $stock; specserve libraries: ${LLAMA_CPP_LIB_PATH:-the installed wheel}"
  .venv/bin/python -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
} | tee "$OUT/machine.txt"

# 1. Cost per call size (the row-cost curve): exact, fast (--no-exact, same build) and stock llama.cpp; then
#    with upstream's tiled threshold (8 rows) in force: the 8-row cliff this build removes.
if [[ "$PARTS" == *" cost "* ]]; then
  $S bench --in-process --exact-cost --stock-lib "$stock" --repeats 5 --output-dir "$OUT/exact-cost"
  GGML_CPU_TILED_MM_MIN_BATCH=8 $S bench --in-process --exact-cost --repeats 3 \
    --output-dir "$OUT/exact-cost-tiled8"
fi
# 2. The default policy against plain decoding on the built-in engine prompts, two rounds; then the edit and
#    summary prompts again with the tiled threshold at 8 (before the cliff was removed).
if [[ "$PARTS" == *" engine "* ]]; then
  $S bench --in-process --modes plain,auto --repeats 2 --max-tokens 128 --output-dir "$OUT/engine-auto"
  GGML_CPU_TILED_MM_MIN_BATCH=8 $S bench --in-process --modes plain,auto --repeats 2 --max-tokens 128 \
    --kinds edit,summary --output-dir "$OUT/engine-auto-tiled8"
fi
# 3. A user's first request: fresh `specserve generate` processes, plain vs auto, two rounds.
if [[ "$PARTS" == *" fresh "* ]]; then
  $S bench --in-process --fresh-process --repeats 2 --max-tokens 160 --output-dir "$OUT/fresh-process"
fi
[[ "$PARTS" == *" server "* ]] || exit 0
# 4. Side by side with stock llama-server (plain: its defaults have no draft model) at concurrency 1.
target=$($S models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
# --poll 0: an idle llama-server otherwise keeps its threads spinning and slows whatever runs next.
"$stock/llama-server" -m "$target" --port "$PEER_PORT" -t "$(nproc)" -c 4096 --poll 0 >/dev/null 2>&1 &
peer=$!
$S serve --port "$PORT" --max-running 1 --log-level warning &
server=$!
trap 'kill $peer $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PEER_PORT/health" >/dev/null; do sleep 2; done
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do sleep 2; done
$S bench --url "http://127.0.0.1:$PORT" --output-dir "$OUT/vs-llama-server" --compare-spec \
  --peer-url "llama-server=http://127.0.0.1:$PEER_PORT" \
  --workload code-writing code-completion code-edit qa summarization creative \
  --concurrency 1 --requests 2 --max-tokens 96
