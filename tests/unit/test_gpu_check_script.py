"""scripts/gpu-check.sh on a machine without an NVIDIA GPU: one line and a distinct exit code.

The checks themselves need a GPU (docs/gpu-check.md); here only the paths that refuse are run.
"""

from __future__ import annotations

import importlib.util
import json
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


def test_every_check_runs_end_to_end_on_a_stand_in_gpu(tmp_path: Path) -> None:
    """The whole script against stand-ins for NVML and torch.cuda (``gpu_stand_in/``).

    The oomguard commands run for real (plan, watch, the release wait); only the device is
    simulated, so a renamed JSON key or a changed face breaks this before a GPU run is spent.
    """
    stand_in = Path(__file__).parent / "gpu_stand_in"
    figures = tmp_path / "figures.json"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(stand_in), os.environ["PATH"]]),
        "PYTHON": sys.executable,
        "OOMGUARD_GPU_CHECK_DEPS": str(stand_in),
        "OOMGUARD_STAND_IN_STATE": str(tmp_path / "held.json"),
        "OOMGUARD_HOME": str(tmp_path),
    }
    run = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu-check.sh"),
            "--cotenant-gib",
            "40",
            "--json",
            str(figures),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    checks = {c["name"]: c for c in json.loads(figures.read_text())}
    assert list(checks) == [
        "nvml-vs-torch",
        "plan-gpu-auto",
        "watch-per-process",
        "serve-wait-release",
    ]
    assert all(c["status"] == "PASS" for c in checks.values()), run.stdout
    plan = checks["plan-gpu-auto"]["figures"]
    # 40 GiB held by the co-tenant (and its 0.5 GiB context) come off what plan sees free
    drop = plan["alone"]["free_gib"] - plan["with_cotenant"]["free_gib"]
    assert 40.0 <= drop <= 41.0
    assert plan["settings"]["gpu_memory_utilization"] < 0.92  # lowered to fit beside it
    watch = checks["watch-per-process"]["figures"]["server"]
    assert watch["gpu_source"] == "nvml-process"
    assert sum(g["used_bytes"] for g in watch["gpus"]) == (40 << 30) + (512 << 20)
    release = checks["serve-wait-release"]["figures"]
    assert release["released"] and release["excess_used_mib"] <= 0
    assert run.stdout.splitlines()[-1].startswith("gpu-check: 4 of 4 checks passed")
