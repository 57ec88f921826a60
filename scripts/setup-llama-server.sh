#!/usr/bin/env bash
# Builds llama-server (and rpc-server: a second ggml device on the CPU, on which the tests check
# the GPU/CPU split for real) from the llama.cpp sources
# that the llama-cpp-python sdist on PyPI ships (MIT), once: the binaries are cached under
#   ${OOMGUARD_CACHE:-~/.cache/oomguard}/llama.cpp/<sdist version>/bin/
# and reused while they run. A portable CPU build: no native CPU flags, no OpenSSL, no web UI
# download, only the two targets. Prints the path of llama-server on its last line.
#   OOMGUARD_LLAMA_CPP_SDIST=0.3.36   the llama-cpp-python version whose sources to build
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${OOMGUARD_LLAMA_CPP_SDIST:-0.3.36}"
CACHE="${OOMGUARD_CACHE:-$HOME/.cache/oomguard}/llama.cpp/$VERSION${OOMGUARD_LLAMA_CPP_OPT:+-opt}"
BIN="$CACHE/bin"
PY="${OOMGUARD_VENV:-.venv}/bin/python"
[ -x "$PY" ] || PY=python3

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/rpc-server" ] && "$BIN/llama-server" --version >/dev/null 2>&1; then
  echo "llama-server $VERSION already built (cached)" >&2
  echo "$BIN/llama-server"
  exit 0
fi

for tool in cmake g++; do
  command -v "$tool" >/dev/null || { echo "$tool not found: run scripts/setup-system.sh" >&2; exit 1; }
done
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
JOBS="${OOMGUARD_BUILD_JOBS:-$(nproc)}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/oomguard-llama-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
echo "downloading the llama-cpp-python $VERSION sdist (llama.cpp sources)" >&2
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$WORK" 2>&1 | grep -v "is ignored" >&2 || true
SDIST="$(ls "$WORK"/llama_cpp_python-*.tar.gz)"
tar -xzf "$SDIST" -C "$WORK"
SRC="$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"

echo "building llama-server and rpc-server with $JOBS jobs (a clean build takes minutes)" >&2
# Unoptimised (-O0, no debug info): the tests serve models of a few hundred KB, where speed does
# not matter and every buffer is the same size as in an optimised build, and -O0 halves the
# compile time (measured: 376 CPU-s against about 720 for Release, llama-server + rpc-server).
# OOMGUARD_LLAMA_CPP_OPT=-O2 builds an optimised binary for real use.
OPT="${OOMGUARD_LLAMA_CPP_OPT:--O0}"
cmake -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_C_FLAGS="$OPT" -DCMAKE_CXX_FLAGS="$OPT" \
  -DGGML_NATIVE=OFF -DGGML_RPC=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$WORK/configure.log" 2>&1 \
  || { tail -30 "$WORK/configure.log" >&2; exit 1; }
nice cmake --build "$WORK/build" --target llama-server ggml-rpc-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log" >&2; exit 1; }

mkdir -p "$BIN"
cp "$WORK/build/bin/llama-server" "$BIN/"
cp "$WORK/build/bin/ggml-rpc-server" "$BIN/rpc-server"
cp "$SRC/LICENSE" "$CACHE/LICENSE-llama.cpp"
echo "llama-cpp-python $VERSION sdist, built $(date -u +%FT%TZ) in $(( $(date +%s) - start )) s" > "$CACHE/BUILD_INFO"
cat "$CACHE/BUILD_INFO" >&2
"$BIN/llama-server" --version >/dev/null 2>&1 || { echo "the built llama-server does not run" >&2; exit 1; }
echo "$BIN/llama-server"
