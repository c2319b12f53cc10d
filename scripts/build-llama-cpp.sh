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
#  * GGML_NATIVE=OFF with the CPU's own features listed explicitly, minus AMX: some VMs advertise AMX but
#    fault on its instructions (seen here: "Illegal instruction" on the first decode with weight repacking).
#  * GPU: set SPECSERVE_LLAMA_CMAKE_ARGS="-DGGML_CUDA=ON" (see README) to build for CUDA instead.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECSERVE_WHEEL_CACHE:-$HOME/.cache/specserve/wheels}"
PY="${PYTHON:-python3}"
PATCH="$(cd "$(dirname "$0")/.." && pwd)/patches/llama.cpp-batch-invariant.patch"

args="-DGGML_LLAMAFILE=OFF -DGGML_CPU_BATCH_INVARIANT=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
args="$args -DLLAMA_BUILD_TOOLS=OFF"
if [[ -n "${SPECSERVE_LLAMA_CMAKE_ARGS:-}" ]]; then
  args="$args $SPECSERVE_LLAMA_CMAKE_ARGS"
elif [[ "$(uname -m)" == "x86_64" ]]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  args="$args -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
              avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    flag=${pair%%:*}; opt=${pair##*:}
    if grep -qw "$flag" <<<"$flags"; then args="$args -DGGML_$opt=ON"; else args="$args -DGGML_$opt=OFF"; fi
  done
fi
patch_hash=$(sha256sum "$PATCH" | cut -c1-16)
key=$(printf '%s %s %s' "$VERSION" "$args" "$patch_hash" | sha256sum | cut -c1-12)
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
