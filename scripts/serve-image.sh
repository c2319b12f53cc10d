#!/usr/bin/env bash
# Serve the image scripts/build-image.sh built, on this machine, with the host's model directory as /models.
#
#   scripts/serve-image.sh chat  [TAG]   # start it, POST one /v1/chat/completions, print the answer, stop (default)
#   scripts/serve-image.sh start [TAG]   # start it and wait until GET /ready answers 200; prints the base URL
#   scripts/serve-image.sh stop          # stop what `start` started
#
# Environment (the script's own knobs are not SPECSERVE_*: that prefix is specserve's settings):
#   SERVE_IMAGE_ROUTE       podman (default): a real `podman run` of the image, with the two flags this
#                           sandbox needs (below); chroot: no OCI runtime at all, the image's rootfs
#                           (buildah mount) entered with chroot as uid 10001, with the image's own
#                           Env, WorkingDir and Cmd; for a host where runc cannot start containers either.
#   SERVE_IMAGE_PORT        host port (default 18000; the container listens on its own 8000)
#   SPECSERVE_MODEL_DIR     host model directory mounted read-only at /models (default
#                           ~/.cache/specserve/models, as `specserve models pull` fills it): the GGUF files
#                           and their .verified stamps, so the container neither downloads nor rehashes
#   SPECSERVE_THREADS       llama.cpp threads in the container (default 2)
#   SERVE_IMAGE_READY_TIMEOUT  seconds to wait for /ready (default 900: loading and calibrating both
#                           models on 2 busy cores takes a few minutes)
#
# Why these podman flags (measured here, see docs/DEPLOYMENT.md):
#  * --runtime runc: Debian's default crun 1.8 refuses this host's hybrid cgroup v1 + v2 layout ("cgroups in
#    hybrid mode not supported"), even with --cgroups=disabled; runc runs with cgroupfs v1.
#  * --ulimit nofile=16384:16384 --ulimit nproc=32768:32768, both: podman asks for nofile 1048576 (also
#    with --ulimit host), or nproc 1048576 when only nofile is given, above this host's hard limits; with
#    no CAP_SYS_RESOURCE the runtime's setrlimit fails.
#  * bridge networking with -p needs iptables (netavark calls it); it is installed below.
# The server is CPU-heavy (model load, calibration, generation): it runs under nice/ionice and
# /tmp/cpu-busy exists while it runs, so that benchmarks on the same machine can wait.
set -euo pipefail
cd "$(dirname "$0")/.."

CMD="${1:-chat}"
TAG="${2:-localhost/specserve:0.1.0}"
ROUTE="${SERVE_IMAGE_ROUTE:-podman}"
PORT="${SERVE_IMAGE_PORT:-18000}"
MODELS="${SPECSERVE_MODEL_DIR:-$HOME/.cache/specserve/models}"
THREADS="${SPECSERVE_THREADS:-2}"
READY_TIMEOUT="${SERVE_IMAGE_READY_TIMEOUT:-900}"
NAME=specserve-image
STATE=/run/specserve-image   # the chroot route's pid and working container
BUSY=/tmp/cpu-busy
LOW=(nice -n 19 ionice -c3)

log() { printf '[serve-image %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# shellcheck source=scripts/apt-need.sh
. scripts/apt-need.sh  # the working directory is the repository root (cd above)

need_tools() {
  # runc: see above. netavark and aardvark-dns: podman's bridge network (only recommended by Debian's
  # podman; without them it falls back to CNI plugins, which are not installed either).
  apt_need podman buildah runc iptables netavark aardvark-dns curl
}

start_podman() {
  podman rm -f --time 5 "$NAME" >/dev/null 2>&1 || true
  # podman schedules the image's HEALTHCHECK with systemd timers; without systemd it logs two
  # "unable to get systemd connection" errors and runs no timer. `podman healthcheck run` still runs the
  # check on demand (the chat below does).
  "${LOW[@]}" podman run -d --name "$NAME" --runtime runc \
    --ulimit nofile=16384:16384 --ulimit nproc=32768:32768 \
    -p "127.0.0.1:$PORT:8000" -v "$MODELS:/models:ro" -e SPECSERVE_THREADS="$THREADS" \
    "$TAG" >/dev/null
}

image_field() { podman image inspect --format "$1" "$TAG"; }

start_chroot() {
  stop_chroot
  mkdir -p "$STATE"
  local ctr mnt user workdir
  ctr=$(buildah from --pull=never "$TAG")
  echo "$ctr" >"$STATE/container"
  mnt=$(buildah mount "$ctr")
  user=$(image_field '{{.Config.User}}')
  workdir=$(image_field '{{.Config.WorkingDir}}')
  local -a env cmd
  mapfile -t env < <(image_field '{{range .Config.Env}}{{println .}}{{end}}' | sed '/^$/d')
  mapfile -t cmd < <(image_field '{{range .Config.Cmd}}{{println .}}{{end}}' | sed '/^$/d')
  # The server in the container binds 8000; here it shares the host's network, so it gets PORT instead.
  env+=("SPECSERVE_THREADS=$THREADS" "SPECSERVE_PORT=$PORT" "HOME=$workdir")
  # A private mount namespace: /proc, /dev, /tmp and the models exist only for the server and vanish
  # with it. setpriv drops to the image's USER (uid:gid 10001) after chroot.
  # shellcheck disable=SC2016  # $1, $2 and $3 expand in the inner shell
  "${LOW[@]}" setsid unshare --mount --propagation private sh -ec '
      root=$1; models=$2; workdir=$3; user=$4; shift 4
      mount -t proc proc "$root/proc"
      mount --rbind /dev "$root/dev"
      mount -t tmpfs tmpfs "$root/tmp"
      mount --bind "$models" "$root/models"
      mount -o remount,bind,ro "$root/models"
      cp /etc/resolv.conf "$root/etc/resolv.conf"
      exec chroot "$root" /usr/bin/setpriv --reuid "${user%%:*}" --regid "${user##*:}" --clear-groups \
        /bin/sh -c "cd \"$workdir\" && exec \"\$@\"" sh "$@"' \
    sh "$mnt" "$MODELS" "$workdir" "$user" /usr/bin/env -i "${env[@]}" "${cmd[@]}" \
    >"$STATE/server.log" 2>&1 &
  echo $! >"$STATE/pid"
}

stop_chroot() {
  if [[ -s "$STATE/pid" ]]; then
    local pid
    pid=$(cat "$STATE/pid")
    # SIGTERM to the session: the server drains, the mount namespace goes with it.
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  if [[ -s "$STATE/container" ]]; then
    buildah rm "$(cat "$STATE/container")" >/dev/null 2>&1 || true
  fi
  rm -rf "$STATE"
}

server_log() {
  if [[ $ROUTE == podman ]]; then podman logs --tail 40 "$NAME" 2>&1; else tail -n 40 "$STATE/server.log"; fi
}

server_alive() {
  if [[ $ROUTE == podman ]]; then
    [[ $(podman inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null) == true ]]
  else
    kill -0 "$(cat "$STATE/pid")" 2>/dev/null
  fi
}

wait_ready() {
  local deadline=$((SECONDS + READY_TIMEOUT))
  until curl -fsS -o /dev/null "http://127.0.0.1:$PORT/ready" 2>/dev/null; do
    if ! server_alive; then
      server_log >&2
      echo "error: the server in $TAG exited before it was ready" >&2
      return 1
    fi
    if ((SECONDS > deadline)); then
      server_log >&2
      echo "error: $TAG not ready after ${READY_TIMEOUT}s" >&2
      return 1
    fi
    sleep 3
  done
}

start() {
  need_tools
  podman image exists "$TAG" || { echo "error: no image $TAG; run scripts/build-image.sh" >&2; exit 1; }
  [[ -d "$MODELS" ]] || { echo "error: no model directory $MODELS; run specserve models pull" >&2; exit 1; }
  touch "$BUSY"
  log "starting $TAG (route $ROUTE) on 127.0.0.1:$PORT, models from $MODELS (read-only)"
  "start_$ROUTE"
  local t0=$SECONDS
  wait_ready
  log "ready after $((SECONDS - t0)) s"
  echo "http://127.0.0.1:$PORT/v1"
}

stop() {
  # Whichever route `start` took: stop does not need SERVE_IMAGE_ROUTE.
  if podman container exists "$NAME" 2>/dev/null; then
    podman rm -f --time 30 "$NAME" >/dev/null
  fi
  stop_chroot
  rm -f "$BUSY"
}

case "$CMD" in
  start) start ;;
  stop) stop ;;
  chat)
    trap stop EXIT
    start >/dev/null
    # The server accepts only the model id it serves (404 otherwise): ask for it.
    model=$(curl -fsS "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
    log "POST /v1/chat/completions (model $model)"
    answer=$(curl -fsS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"Write a Python function that returns the square of x.\"}], \"max_tokens\": 48, \"temperature\": 0}")
    printf '%s\n' "$answer"
    # A real answer: some text, and a finish reason the API defines.
    python3 -c 'import json, sys
c = json.loads(sys.argv[1])["choices"][0]
assert c["message"]["content"].strip(), "empty answer"
assert c["finish_reason"] in ("stop", "length"), c["finish_reason"]
print("ok: finish_reason=%s, %d chars" % (c["finish_reason"], len(c["message"]["content"])), file=sys.stderr)' "$answer"
    if [[ $ROUTE == podman ]]; then
      podman healthcheck run "$NAME" >/dev/null
      log "ok: the image's HEALTHCHECK passes (podman healthcheck run)"
    fi
    ;;
  *) echo "usage: $0 {chat|start|stop} [TAG]" >&2; exit 2 ;;
esac
