"""scripts/gpu-check.sh on a machine without an NVIDIA GPU: one line and a distinct exit code.

The checks themselves need a GPU (docs/gpu-check.md); here only the paths that refuse are run.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any NVML failure means no usable GPU here
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_nvidia_smi_it_says_so_in_one_line_and_exits_3() -> None:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 3
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0] and "nvidia-smi" in lines[0]


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_a_missing_module_is_named_with_the_fix_and_exits_2() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "torch (PyTorch with CUDA)" in lines[0] and "PYTHON=" in lines[0]


@pytest.mark.skipif(_nvml_works(), reason="NVML works here: this machine has a GPU")
def test_with_every_module_but_no_driver_it_exits_3(tmp_path: Path) -> None:
    (tmp_path / "torch.py").write_text("")  # present for the module check; never imported
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])},
    )
    assert run.returncode == 3, run.stderr
    assert run.stderr.strip() == "gpu-check: NVML sees no NVIDIA GPU on this machine"
