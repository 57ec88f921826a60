#!/usr/bin/env bash
# The checks only a machine with an NVIDIA GPU can make, in under 8 minutes, with nothing
# downloaded: NVML's free memory against torch.cuda.mem_get_info, `plan --gpu auto` while a
# co-tenant process holds GPU memory, `watch`'s per-process GPU memory of that process, and
# serve's wait for the memory to come back as the process frees it and exits
# (scripts/gpu_check.py; docs/gpu-check.md).
#
#   bash scripts/gpu-check.sh [--cotenant-gib N] [--json FILE]
#   PYTHON=/path/to/python          the interpreter with PyTorch (CUDA) and nvidia-ml-py
#   OOMGUARD_GPU_CHECK_DEPS=DIR     oomguard's own runtime modules, when that python lacks them
#   bash scripts/gpu-check.sh --prepare DIR [PYTHON_VERSION]
#                                   (on a machine with network) put those modules into DIR as
#                                   wheels for PYTHON_VERSION (default: this python3's), to copy
#                                   to the GPU machine
#
# Exit codes: 0 every check passed, 1 a check failed, 2 a module is missing, 3 no NVIDIA GPU,
# 124 the 8-minute limit ran out.
set -euo pipefail
cd "$(dirname "$0")/.."

# oomguard's runtime modules that plan and watch import, as pyproject.toml pins them; numpy is
# left out (most PyTorch installs carry it, and it alone is 70 MB)
RUNTIME_MODULES=("typer>=0.12,<0.29" rich pyyaml psutil aiohttp prometheus-client nvidia-ml-py)

if [ "${1:-}" = "--prepare" ]; then
  dir="${2:?usage: gpu-check.sh --prepare DIR [PYTHON_VERSION]}"
  version="${3:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
  python3 -m pip install -q --disable-pip-version-check --target "$dir" --only-binary=:all: \
    --python-version "$version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 "${RUNTIME_MODULES[@]}"
  echo "prepared $dir for Python $version: run OOMGUARD_GPU_CHECK_DEPS=$dir bash scripts/gpu-check.sh"
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi not found); run it on a machine with one" >&2
  exit 3
fi

PY="${PYTHON:-python3}"
deps="${OOMGUARD_GPU_CHECK_DEPS:-}"
export PYTHONPATH="$PWD/src${deps:+:$deps}${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
exec timeout 480 "$PY" scripts/gpu_check.py "$@"
