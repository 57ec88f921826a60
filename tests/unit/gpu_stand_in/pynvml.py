"""A stand-in for NVML on a machine without a GPU: one H200 whose processes are in a state file.

Only what scripts/gpu_check.py and oomguard read is provided. Processes register their bytes
through the ``torch`` stand-in beside this file; a process that has exited (or is a zombie) no
longer holds memory, as with a real driver.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

TOTAL = 143771 << 20  # an H200 as nvidia-smi reports it
RESERVED = 700 << 20
BASE_USED = RESERVED + (300 << 20)
STATE = os.environ["OOMGUARD_STAND_IN_STATE"]
nvmlMemory_v2 = 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def processes() -> dict[int, int]:
    """pid → bytes of the processes alive now."""
    try:
        with open(STATE) as f:
            held = json.load(f)
    except (OSError, ValueError):
        held = {}
    return {int(pid): n for pid, n in held.items() if _alive(int(pid))}


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetName(handle: int) -> str:
    return "NVIDIA H200"


def nvmlDeviceGetMemoryInfo(handle: int, version: int | None = None) -> SimpleNamespace:
    """v1 counts the driver's reserve as used; v2 reports it apart, as a real driver does."""
    used = BASE_USED + sum(processes().values())
    if version is None:
        return SimpleNamespace(total=TOTAL, used=used, free=TOTAL - used)
    return SimpleNamespace(total=TOTAL, used=used - RESERVED, free=TOTAL - used, reserved=RESERVED)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(pid=pid, usedGpuMemory=n) for pid, n in processes().items()]


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return []
