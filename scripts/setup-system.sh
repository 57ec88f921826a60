#!/usr/bin/env bash
# Install the system programs the tests run for real, from Debian's packages, when missing:
#   redis-server  (package redis-server)  shared admission state of guard replicas
#   promtool      (package prometheus)    checks and unit-tests the alert rules in deploy/
#   chromium      (package chromium)      opens the HTML reports headless, takes screenshots
#   prometheus-alertmanager (same package) receives oomguard watch's alerts in its tests
#   cmake, ninja, g++ (cmake, ninja-build, g++)  build llama-server (scripts/setup-llama-server.sh)
# Idempotent: nothing is installed when every command is already there. Needs root (or sudo)
# and apt-get; elsewhere it names what is missing and exits non-zero.
set -euo pipefail

declare -A package_of=(
  [redis-server]=redis-server
  [promtool]=prometheus
  [chromium]=chromium
  [prometheus-alertmanager]=prometheus-alertmanager
  [cmake]=cmake
  [ninja]=ninja-build
  [g++]=g++
)

missing=()
for cmd in "${!package_of[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${package_of[$cmd]}")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "system programs ready: ${!package_of[*]}"
  exit 0
fi

sudo=()
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "missing system packages: ${missing[*]} (install them as root: apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "missing system packages: ${missing[*]} (no apt-get here: install them with your package manager)" >&2
  exit 1
fi
echo "installing system packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
for cmd in "${!package_of[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || { echo "$cmd still missing after the install" >&2; exit 1; }
done
echo "system programs ready: ${!package_of[*]}"
