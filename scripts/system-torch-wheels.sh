#!/usr/bin/env bash
# Wheels for scripts/install.sh --system-torch on a machine without the network (the device machine: Python
# 3.12, torch 2.11 + CUDA 13 preinstalled, nothing fetchable). Run here, where PyPI is reachable:
#   scripts/system-torch-wheels.sh DIR [--python-version 3.12] [--skip NAME ...]
# DIR gets specserve's requirements (the torch extra without torch) and their dependencies as manylinux
# x86_64 wheels for that Python, then llama-cpp-python's portable AVX2 build (SPECSERVE_LLAMA_ISA=avx2
# scripts/build-llama-cpp.sh: a native build runs only on the CPU kind that built it; the first build takes
# minutes). --skip drops packages the other machine has already (pip would keep its own copy anyway, the
# flag only saves room: a device call carries 64 MiB in all). Prints DIR's size.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: scripts/system-torch-wheels.sh DIR [--python-version X.Y] [--skip NAME ...]}"
shift
version=3.12
skip=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) version="$2"; shift 2 ;;
    --skip) skip+=("$2"); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$dir"
mapfile -t requirements < <("$PY" -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = project["dependencies"] + project["optional-dependencies"]["torch"]
print("\n".join(r for r in wanted if not r.startswith(("torch", "llama-cpp-python"))))')
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
  manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --implementation cp \
  --python-version "$version" "${platforms[@]}" -d "$dir" "${requirements[@]}"
llama=$(SPECSERVE_LLAMA_ISA=avx2 PYTHON="$PY" scripts/build-llama-cpp.sh)
cp "$llama" "$dir/"
# llama-cpp-python's own requirements (pure Python) beside it
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --implementation cp \
  --python-version "$version" "${platforms[@]}" --platform linux_x86_64 -d "$dir" "$llama"
for name in "${skip[@]}"; do
  rm -f "$dir"/"$(echo "$name" | tr - _)"-*.whl "$dir"/"$name"-*.whl
done
du -sh "$dir" >&2
