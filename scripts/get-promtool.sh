#!/usr/bin/env bash
# Print the path of a promtool binary (Prometheus' rule and config checker), fetching it when needed.
# Usage: scripts/get-promtool.sh            (the path on stdout; progress and errors on stderr)
#
# In order: $PROMTOOL if set; promtool on PATH; a cached copy at
# ${XDG_CACHE_HOME:-~/.cache}/specserve/promtool/<version>/promtool; else Debian's prometheus package,
# downloaded with `apt-get download` (works as any user; as root, `apt-get update` first if the package
# lists lack it) and only /usr/bin/promtool taken out of it, into the cache. Nothing is installed
# system-wide and no service is started. Exit status 1, with the reason on stderr, when none can be had.
set -euo pipefail

say() { echo "get-promtool: $*" >&2; }

works() { [[ -x "$1" ]] && "$1" --version >/dev/null 2>&1; }

if [[ -n "${PROMTOOL:-}" ]]; then
    works "$PROMTOOL" || { say "PROMTOOL=$PROMTOOL does not run"; exit 1; }
    echo "$PROMTOOL"
    exit 0
fi

if found=$(command -v promtool 2>/dev/null) && works "$found"; then
    echo "$found"
    exit 0
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}/specserve/promtool"
# Newest cached version first (version-sorted directory names).
if [[ -d "$cache" ]]; then
    while IFS= read -r dir; do
        if works "$cache/$dir/promtool"; then
            echo "$cache/$dir/promtool"
            exit 0
        fi
    done < <(find "$cache" -mindepth 1 -maxdepth 1 -type d ! -name '.*' -printf '%f\n' | sort -rV)
fi

for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null || { say "no promtool on PATH or in $cache, and no $tool to fetch one"; exit 1; }
done

mkdir -p "$cache"
work=$(mktemp -d "$cache/.fetch.XXXXXX")  # beside the cache: the final mv is a rename
trap 'rm -rf "$work"' EXIT

apt_opts=()
# As root, apt drops to the _apt user for downloads, which cannot write into a 0700 temp dir.
[[ $(id -u) -eq 0 ]] && apt_opts=(-o APT::Sandbox::User=root)

download() { (cd "$work" && apt-get "${apt_opts[@]}" download prometheus) >&2; }

if ! download; then
    if [[ $(id -u) -eq 0 ]]; then
        say "apt-get download failed; updating the package lists and trying again"
        apt-get update >&2 && download || { say "could not download Debian's prometheus package"; exit 1; }
    else
        say "apt-get download prometheus failed (package lists missing or stale? run 'apt-get update' as root)"
        exit 1
    fi
fi

deb=$(find "$work" -maxdepth 1 -name 'prometheus_*.deb' | head -n 1)
[[ -n "$deb" ]] || { say "apt-get download left no prometheus_*.deb"; exit 1; }
version=$(dpkg-deb -f "$deb" Version)
version=${version//[^A-Za-z0-9.+~_-]/_}
mkdir -p "$work/x"
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/x" ./usr/bin/promtool
works "$work/x/usr/bin/promtool" || { say "the promtool of $deb does not run here"; exit 1; }

mkdir -p "$work/out"
mv "$work/x/usr/bin/promtool" "$work/out/promtool"
if ! mv -T "$work/out" "$cache/$version" 2>/dev/null; then
    # Another run cached the same version meanwhile: use that copy.
    works "$cache/$version/promtool" || { say "cannot write $cache/$version"; exit 1; }
fi
say "cached $(dpkg-deb -f "$deb" Package) $version's promtool in $cache/$version"
echo "$cache/$version/promtool"
