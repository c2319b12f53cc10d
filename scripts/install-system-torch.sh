#!/usr/bin/env bash
# scripts/install.sh --system-torch [--wheels DIR]: install specserve into .venv on a machine whose torch is
# preinstalled (a GPU box's CUDA build, say the device machine's torch 2.11 + CUDA 13) and that may have no
# network. The venv sees every package of PYTHON (default python3; its torch, triton, numpy, transformers)
# through a .pth file, and pip installs specserve (editable) and whatever it lacks from DIR's wheels only,
# never from an index: a requirement neither installed for PYTHON nor in DIR is named and the script exits 1.
# DIR comes from scripts/system-torch-wheels.sh, run on a machine with the network (it holds llama-cpp-
# python's portable build, which no machine without a compiler and the network can make).
#   VENV=<dir> (default .venv) installs elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
wheels=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) wheels="$(cd "${2:?--wheels DIR}" && pwd)"; shift 2 ;;
    *) echo "usage: scripts/install.sh --system-torch [--wheels DIR]" >&2; exit 2 ;;
  esac
done
if ! torch_version=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  echo "install.sh --system-torch: $PY has no torch; on a machine without one run scripts/install.sh --torch" >&2
  exit 2
fi
# The interpreter's own site directories: appended to the venv's sys.path after its own site-packages, so
# what the venv installs comes first and torch is PYTHON's. pip counts their packages as installed.
site_dirs=$("$PY" -c 'import site, sys; print("\n".join(d for d in [*site.getsitepackages(), site.getusersitepackages()] if d in sys.path))')
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv --without-pip "$VENV"  # ensurepip may be missing; PYTHON's pip installs
venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$site_dirs" >"$venv_site/specserve-system-site.pth"
# The torch extra without torch itself: safetensors and tokenizers.
mapfile -t extra < <("$PY" -c '
import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["torch"]
print("\n".join(r for r in extra if not r.startswith("torch")))')
args=(--no-index --no-build-isolation --disable-pip-version-check)
[[ -n "$wheels" ]] && args+=(--find-links "$wheels")
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$PY" -m pip --python "$VENV/bin/python" install --quiet "${args[@]}" -e . "${extra[@]}" 2>"$log"; then
  missing=$(sed -n 's/.*No matching distribution found for \(.*\)/\1/p' "$log" | head -1)
  if [[ -n "$missing" ]]; then
    echo "install.sh --system-torch: missing $missing: not installed for $PY and no wheel in ${wheels:-(no --wheels DIR)}." >&2
    echo "  Make the wheels where the network is (scripts/system-torch-wheels.sh DIR) and pass --wheels DIR." >&2
  else
    cat "$log" >&2
  fi
  exit 1
fi
"$VENV/bin/python" -c 'import specserve.backends.torch.runtime' || exit 1
echo "installed: specserve in $VENV on $PY's torch $torch_version (nothing fetched)" >&2
