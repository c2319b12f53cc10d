#!/usr/bin/env bash
# specserve's llama.cpp kernels against stock llama.cpp, decode calls of 1-48 rows, in ONE process: both
# builds loaded side by side (scripts/kernel-ab.cpp, dlmopen), calls alternating between them round by
# round. Separate processes per build (benchmarks/exact_cost.py) cannot tell a few per cent apart on a
# VM whose speed drifts by +-20 % between runs; this can. Arms: stock llama.cpp of the same instruction set
# (default flags: tiled kernel from 8 rows), specserve's build with the tiled kernel's start the engine
# measures on this machine (llama_cpp_tiled.py), and specserve's build with the start forced to 8 and 32.
#   scripts/bench-kernels.sh native|avx2 [ROUNDS] [DEPTH]     (writes docs/bench/cpu-<isa>/kernels.md)
# Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
isa="${1:?usage: scripts/bench-kernels.sh native|avx2 [ROUNDS] [DEPTH]}"
rounds="${2:-12}"
depth="${3:-64}"
OUT=${OUT:-docs/bench/cpu-$isa}
stock=$(SPECSERVE_LLAMA_ISA=$isa PYTHON=.venv/bin/python scripts/build-stock-llama.sh)
wheel=$(SPECSERVE_LLAMA_ISA=$isa PYTHON=.venv/bin/python scripts/build-llama-cpp.sh)
ours="$HOME/.cache/specserve/lib-$isa/$(basename "$(dirname "$wheel")")"
if [[ ! -f "$ours/llama_cpp/lib/libllama.so" ]]; then
  mkdir -p "$ours"
  .venv/bin/python -m zipfile -e "$wheel" "$ours"
fi
ours="$ours/llama_cpp/lib"
include=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/include
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
g++ -O2 -std=c++17 -I "$include" -o "$bin/kernel-ab" scripts/kernel-ab.cpp -ldl
model=$(.venv/bin/specserve models pull qwen2.5-coder-1.5b-instruct | sed 's/^[^:]*: //')
# The start an engine would choose here (the same measurement, in a process of its own).
start=$(LLAMA_CPP_LIB_PATH="$ours" .venv/bin/python - "$model" <<'EOF'
import sys
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.backends.llama_cpp_tiled import tiled_min_batch
runtime = LlamaCppRuntime(sys.argv[1], context_per_sequence=256, n_threads=2)
runtime.tune_kernels(0)
print(tiled_min_batch())
EOF
)
mkdir -p "$OUT"
{
  echo "# Kernels: specserve's build against stock llama.cpp, one process"
  echo
  echo "\`scripts/bench-kernels.sh $isa $rounds $depth\` on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) (family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs))," \
       "$(nproc) threads, KV depth $depth, $rounds rounds; the tiled start measured here: $start rows."
  echo "Columns: median ms per call of that many rows (all logits, as a verify needs them), and the median over"
  echo "rounds of the build's time / stock's. stock = $stock; ours = $ours."
  echo
  # OpenMP's idle threads of the builds not running spin for a short while only (not for 300k spins)
  GOMP_SPINCOUNT=10000 "$bin/kernel-ab" "$model" "$(nproc)" "$rounds" "$depth" 1,2,3,4,6,8,12,16,24,32,48 \
    "$stock" "$ours@$start" "$ours@8" "$ours@32" 2>/dev/null | sed -e "s#$stock#stock#g" -e "s#$ours#ours#g"
} | tee "$OUT/kernels.md"
