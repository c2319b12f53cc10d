#!/usr/bin/env bash
# Build (once) and print the path of a llama-cpp-python wheel for this CPU, cached by version, flags and patch.
#
# Why a custom build:
#  * patches/llama.cpp-batch-invariant.patch with -DGGML_CPU_BATCH_INVARIANT=ON: every row of a matmul
#    is computed the same way whatever the batch size (ggml otherwise switches Q4_K gemv/gemm and Q6_K
#    vec_dot/tiled kernels by row count), so a token verified inside a k-row batch gets the logits it
#    would get alone and exact mode can keep weight repacking and any verify size. The patch must
#    apply: an unpatched wheel that exact mode would trust is never built.
#  * -DGGML_LLAMAFILE=OFF: llamafile's sgemm also switches kernels by batch size.
#  * -DGGML_CPU_TILED_MIN_BATCH=32 (the patch makes it an option): where ggml's tiled K-quant kernel takes
#    over from vec_dot when nothing measured it (upstream: 8 rows, where it cost 1.2-1.5x vec_dot on AMD
#    Zen 4: the 8-row cost cliff of verify calls). The engine measures the best start on the target at
#    calibration and sets it at run time (src/specserve/backends/llama_cpp_tiled.py): on Zen 5 it is 8-12
#    rows with AVX-512, 12-16 AVX2-only (docs/BENCHMARKS.md).
#  * llama.cpp's default GGML_NATIVE=ON (-march=native, as a user's own build of llama.cpp has), plus
#    -mno-amx-* where the CPU advertises AMX: some VMs advertise it but fault on its instructions (seen
#    here: SIGSEGV in ggml_backend_amx_mul_mat on the first prompt batch). The cache key includes the
#    CPU's model and flags, since a native wheel runs only on the CPU kind that built it.
#  * SPECSERVE_LLAMA_ISA=avx2: the portable AVX2-only build instead of -march=native (GGML_NATIVE=OFF,
#    AVX2 + FMA + F16C + BMI2, no AVX-512, no AMX; scripts/llama-avx2.cmake-args), e.g. to measure the
#    AVX2 kernels on a CPU that has AVX-512. A second cached wheel; install it with
#    SPECSERVE_LLAMA_ISA=avx2 scripts/install.sh.
#  * GPU: set SPECSERVE_LLAMA_CMAKE_ARGS="-DGGML_CUDA=ON" (see README) to build for CUDA instead.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECSERVE_WHEEL_CACHE:-$HOME/.cache/specserve/wheels}"
PY="${PYTHON:-python3}"
PATCH="$(cd "$(dirname "$0")/.." && pwd)/patches/llama.cpp-batch-invariant.patch"

args="-DGGML_LLAMAFILE=OFF -DGGML_CPU_BATCH_INVARIANT=ON -DGGML_CPU_TILED_MIN_BATCH=32"
args="$args -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
args="$args -DLLAMA_BUILD_TOOLS=OFF"
if [[ -n "${SPECSERVE_LLAMA_CMAKE_ARGS:-}" ]]; then
  args="$args $SPECSERVE_LLAMA_CMAKE_ARGS"
elif [[ "${SPECSERVE_LLAMA_ISA:-native}" == "avx2" ]]; then
  args="$args $(cat "$(dirname "$0")/llama-avx2.cmake-args")"
elif [[ "${SPECSERVE_LLAMA_ISA:-native}" != "native" ]]; then
  echo "error: SPECSERVE_LLAMA_ISA must be native or avx2, not ${SPECSERVE_LLAMA_ISA}" >&2
  exit 2
elif [[ "$(uname -m)" == "x86_64" ]]; then
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    args="$args -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
    args="$args -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
  fi
fi
cpu=$(grep -m2 -E '^(model name|flags)' /proc/cpuinfo 2>/dev/null | sha256sum | cut -c1-16 || true)
patch_hash=$(sha256sum "$PATCH" | cut -c1-16)
key=$(printf '%s %s %s %s' "$VERSION" "$args" "$patch_hash" "$cpu" | sha256sum | cut -c1-12)
dest="$CACHE/$key"
wheel=$(ls "$dest"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$wheel" ]]; then
  mkdir -p "$dest"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$work" "llama-cpp-python==$VERSION" >&2
  tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
  src="$work/llama_cpp_python-$VERSION"
  if ! patch --batch --forward --fuzz=0 --silent -p1 -d "$src/vendor/llama.cpp" <"$PATCH" >&2; then
    echo "error: $PATCH does not apply to llama-cpp-python $VERSION; refusing to build an unpatched" \
         "wheel (exact mode would trust it). Update the patch for this version." >&2
    exit 1
  fi
  echo "building llama-cpp-python $VERSION + batch-invariant patch ($args); takes ~6-11 minutes on 2 cores" >&2
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip wheel --no-deps -w "$dest" "$src" >&2
  wheel=$(ls "$dest"/llama_cpp_python-"$VERSION"-*.whl | head -n1)
fi
echo "$wheel"
