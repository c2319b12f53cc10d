#!/usr/bin/env bash
# Build (once) and print the path of a llama-cpp-python wheel for this CPU, cached by version and flags.
#
# Why a custom build:
#  * -DGGML_LLAMAFILE=OFF: llamafile's sgemm computes a batch with different kernels than one token, so
#    a token's logits would depend on the verify batch size; specserve's exact mode needs them identical.
#  * GGML_NATIVE=OFF with the CPU's own features listed explicitly, minus AMX: some VMs advertise AMX but
#    fault on its instructions (seen here: "Illegal instruction" on the first decode with weight repacking).
#  * GPU: set SPECSERVE_LLAMA_CMAKE_ARGS="-DGGML_CUDA=ON" (see README) to build for CUDA instead.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECSERVE_WHEEL_CACHE:-$HOME/.cache/specserve/wheels}"
PY="${PYTHON:-python3}"

args="-DGGML_LLAMAFILE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
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
key=$(printf '%s %s' "$VERSION" "$args" | sha256sum | cut -c1-12)
dest="$CACHE/$key"
wheel=$(ls "$dest"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$wheel" ]]; then
  mkdir -p "$dest"
  echo "building llama-cpp-python $VERSION ($args); takes ~6-11 minutes on 2 cores" >&2
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip wheel --no-deps --no-binary llama-cpp-python -w "$dest" "llama-cpp-python==$VERSION" >&2
  wheel=$(ls "$dest"/llama_cpp_python-"$VERSION"-*.whl | head -n1)
fi
echo "$wheel"
