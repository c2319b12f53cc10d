#!/usr/bin/env bash
# Build (once) llama.cpp's own llama-bench and llama-server from the same sources specserve uses (the vendored
# llama.cpp of the llama-cpp-python sdist), *unpatched* and with llama.cpp's default flags, as a user would
# build them; print the directory holding the binaries. scripts/benchmarks.sh compares specserve against them.
#
# One deviation from the defaults, where needed: on a CPU that advertises AMX, -march=native compiles ggml's
# AMX kernels, and on VMs that fault on AMX (this project's machine kind) llama-bench then dies with SIGSEGV
# in ggml_backend_amx_mul_mat on the first prompt batch. There the build adds -mno-amx-* (GCC keeps an
# explicit -mno-X over what -march=native implies); everything else stays at llama.cpp's defaults
# (GGML_NATIVE=ON, GGML_LLAMAFILE=ON, OpenMP).
#
# SPECSERVE_LLAMA_ISA=avx2 builds the portable AVX2-only variant instead (GGML_NATIVE=OFF, AVX2 + FMA + F16C
# + BMI2, no AVX-512, no AMX: the Dockerfile's flags), to compare with specserve's AVX2-only wheel
# (scripts/build-llama-cpp.sh with the same variable) on a CPU that has AVX-512.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECSERVE_STOCK_LLAMA_CACHE:-$HOME/.cache/specserve/stock-llama}"
PY="${PYTHON:-python3}"

cflags=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
isa_args=""
if [[ "${SPECSERVE_LLAMA_ISA:-native}" == "avx2" ]]; then
  cflags=""
  isa_args="$(cat "$(dirname "$0")/llama-avx2.cmake-args")"
elif [[ "${SPECSERVE_LLAMA_ISA:-native}" != "native" ]]; then
  echo "error: SPECSERVE_LLAMA_ISA must be native or avx2, not ${SPECSERVE_LLAMA_ISA}" >&2
  exit 2
fi
dest="$CACHE/$VERSION-$(printf '%s' "$cflags${isa_args:+ $isa_args}" | sha256sum | cut -c1-8)"
if [[ ! -x "$dest/bin/llama-bench" || ! -x "$dest/bin/llama-server" ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$work" "llama-cpp-python==$VERSION" >&2
  tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  echo "building stock llama-bench and llama-server (llama.cpp of llama-cpp-python $VERSION); ~6 minutes" >&2
  # The build tree is the cache entry: its binaries find their shared libraries by RUNPATH in $dest/bin.
  rm -rf "$dest"
  # shellcheck disable=SC2086  # isa_args is a list of -D flags
  cmake -S "$src" -B "$dest" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" $isa_args >&2
  cmake --build "$dest" -j "$(nproc)" --target llama-bench llama-server >&2
fi
echo "$dest/bin"
