#!/usr/bin/env bash
# Build the real specserve image from deploy/Dockerfile on a machine without Docker Hub (or any registry),
# without a Docker daemon, and where the default OCI runtime (crun) cannot start containers (see
# docs/DEPLOYMENT.md, "Building and serving the image here").
#
#   scripts/build-image.sh [TAG]          # default TAG: localhost/specserve:0.1.0
#
# Environment (the script's own knobs are not SPECSERVE_*: that prefix is specserve's settings):
#   BUILD_IMAGE_CACHE       where the base rootfs tarball is kept (default ~/.cache/specserve/image)
#   BUILD_IMAGE_BASE        name of the local base image (default localhost/specserve-base:bookworm-py3.11)
#   DEBIAN_MIRROR           default http://deb.debian.org/debian
#   EXTRAS                  passed to the Dockerfile's EXTRAS build argument (e.g. "ray")
#   BUILD_IMAGE_CA_BUNDLE   a CA bundle the RUN steps trust instead of the image's own (default: the
#                           host's /etc/ssl/certs/ca-certificates.crt where the host adds local CAs in
#                           /usr/local/share/ca-certificates, e.g. a TLS-intercepting egress proxy;
#                           "none" to never mount one)
#
# How:
#  * The base replaces python:3.11-slim-bookworm: debootstrap (minbase) of Debian bookworm plus Debian's
#    python3.11 and python3.11-venv, with /usr/local/bin/python3.11, python3 and python linking to it,
#    so the Dockerfile's `python -m venv` works unchanged and the interpreter path is the same in both
#    stages. It is imported into the local container storage and its tarball is cached, so a second run
#    neither debootstraps nor re-imports.
#  * buildah bud --isolation chroot: RUN steps run in a chroot, without an OCI runtime (crun fails here on
#    the hybrid cgroup layout; runc would work, but needs ulimit and network setup) and with the host's
#    network (PyPI and the Debian mirror are reachable, nothing else).
#  * --layers: every step is cached in the local storage, so a rebuild after a source edit reuses the
#    llama.cpp compile (the Dockerfile copies the build script before src/ for that reason).
#  * The host's CA bundle is bind-mounted over the build's during RUN steps only (a build volume is not
#    committed), so pip reaches PyPI through an intercepting proxy without its CA entering the image.
#  * --format docker keeps the HEALTHCHECK, which the OCI image format has no field for.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG="${1:-localhost/specserve:0.1.0}"
CACHE="${BUILD_IMAGE_CACHE:-$HOME/.cache/specserve/image}"
BASE="${BUILD_IMAGE_BASE:-localhost/specserve-base:bookworm-py3.11}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_TAR="$CACHE/bookworm-py3.11-rootfs.tar"
# The CPU-heavy steps run with the lowest CPU and I/O priority, and /tmp/cpu-busy exists while they
# run, so that timing benchmarks on the same (small) machine can wait for them.
BUSY=/tmp/cpu-busy
LOW=(nice -n 19 ionice -c3)

log() { printf '[build-image %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# shellcheck source=scripts/apt-need.sh
. scripts/apt-need.sh  # the working directory is the repository root (cd above)

# One EXIT trap for everything to undo, so a failure (set -e) cleans up as well as success does.
WORK=""
cleanup() {
  rm -f "$BUSY"
  if [[ -n "$WORK" ]]; then
    umount -l "$WORK/rootfs/proc" 2>/dev/null || true
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

need_tools() {
  # podman: import the base and inspect images (same storage as buildah); ionice is in util-linux.
  apt_need buildah podman debootstrap
}

make_base_tar() {
  WORK=$(mktemp -d /var/tmp/specserve-base.XXXXXX)
  local work="$WORK"
  log "debootstrap bookworm (minbase) from $MIRROR"
  # minbase, then apt inside the chroot: debootstrap's own --include resolver misses python3.11-venv's
  # dependency on python3.11-distutils and leaves it unconfigured.
  "${LOW[@]}" debootstrap --variant=minbase bookworm "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    exit 1
  }
  # The same apt sources as the official debian:bookworm images, so the Dockerfile's apt-get
  # gets security updates too.
  rm -f "$work/rootfs/etc/apt/sources.list"
  cat >"$work/rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  cp /etc/resolv.conf "$work/rootfs/etc/resolv.conf"
  mount -t proc proc "$work/rootfs/proc"
  log "installing python3.11 into the base"
  "${LOW[@]}" chroot "$work/rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    sh -ec 'apt-get update -qq
            apt-get install -y -qq --no-install-recommends python3.11 python3.11-venv ca-certificates netbase tzdata >/dev/null
            apt-get clean
            rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt/* /var/log/dpkg.log
            # python:3.11-slim-bookworm has its interpreter in /usr/local/bin; the Dockerfile relies on
            # `python`, and on one interpreter path in both stages.
            for name in python3.11 python3 python; do ln -sf /usr/bin/python3.11 /usr/local/bin/$name; done
            /usr/local/bin/python -c "import venv, ensurepip, ssl"'
  umount "$work/rootfs/proc"
  # A container runtime provides its own resolv.conf and hostname.
  : >"$work/rootfs/etc/resolv.conf"
  rm -f "$work/rootfs/etc/hostname"
  mkdir -p "$CACHE"
  tar --numeric-owner --xattrs -C "$work/rootfs" -cf "$BASE_TAR.part" .
  mv "$BASE_TAR.part" "$BASE_TAR"
  rm -rf "$work"
  WORK=""
}

need_tools
if ! podman image exists "$BASE"; then
  # dpkg unpacking and configuring a few hundred packages is a minute of CPU: mark it busy too.
  touch "$BUSY"
  [[ -s "$BASE_TAR" ]] || make_base_tar
  log "importing $BASE_TAR as $BASE"
  # The environment python:3.11-slim-bookworm sets, and its default command.
  podman import \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$BASE_TAR" "$BASE" >/dev/null
fi

ca_args=()
ca="${BUILD_IMAGE_CA_BUNDLE:-}"
if [[ -z "$ca" ]] && compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  ca=/etc/ssl/certs/ca-certificates.crt
fi
if [[ -n "$ca" && "$ca" != none ]]; then
  log "RUN steps trust the CA bundle $ca (not copied into the image)"
  ca_args=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
fi

touch "$BUSY"
log "building $TAG from deploy/Dockerfile on $BASE (the first build compiles llama.cpp: ~10+ minutes)"
start=$(date +%s)
"${LOW[@]}" buildah bud --isolation chroot --layers --format docker --pull=never \
  --build-arg PYTHON_IMAGE="$BASE" --build-arg EXTRAS="${EXTRAS:-}" "${ca_args[@]}" \
  -f deploy/Dockerfile -t "$TAG" .
rm -f "$BUSY"
log "built $TAG in $(($(date +%s) - start)) s; $(podman image inspect --format '{{.Size}}' "$TAG") bytes"
