#!/usr/bin/env bash
# System packages the tests need: bubblewrap (code-reward sandbox); util-linux gives
# prlimit and setpriv. Idempotent and quiet; needs root (or sudo) when something is missing.
set -euo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
{ command -v prlimit >/dev/null 2>&1 && command -v setpriv >/dev/null 2>&1; } || need+=(util-linux)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
# Another apt may hold the lock for a while; wait for it instead of failing.
for _ in $(seq 60); do
  if $SUDO apt-get update -qq >/dev/null && \
     $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
    exit 0
  fi
  sleep 5
done
echo "install_system.sh: could not install ${need[*]}" >&2
exit 1
