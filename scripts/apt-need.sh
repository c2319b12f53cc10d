# Sourced by scripts/build-image.sh and scripts/serve-image.sh: install the Debian packages a script needs
# and the machine lacks. The caller defines log().
apt_need() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || { echo "error: needs root to install ${missing[*]}" >&2; exit 1; }
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}
