#!/usr/bin/env bash
# System packages the demo and the tests need: bubblewrap (the code-reward sandbox),
# util-linux (prlimit, setpriv: the sandbox's rlimits and uid drop), shellcheck (script
# tests). Idempotent and quiet; needs root (or sudo) only when something is missing.
# The sandbox also needs cgroups (memory, pids) and, when not root, user namespaces:
# `python -m klear_jax.rewards.selfcheck` says whether this host gives them.
set -euo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
{ command -v prlimit >/dev/null 2>&1 && command -v setpriv >/dev/null 2>&1; } || need+=(util-linux)
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
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
