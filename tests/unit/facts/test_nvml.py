"""One NVML reader: GPU detection and the engine's memory readings see the same figures."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from oomguard.engine.memory import gpu_memory
from oomguard.facts.gpus import NoGPUDetected, detect_gpus
from oomguard.facts.nvml import NvmlUnavailable, read_devices

GIB = 2**30


def _fake_pynvml(*, init_error: bool = False) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.nvmlMemory_v2 = 2  # type: ignore[attr-defined]

    def init() -> None:
        if init_error:
            raise RuntimeError("Driver Not Loaded")

    def memory(handle: int, version: int = 1) -> SimpleNamespace:
        if version == 2:
            return SimpleNamespace(total=80 * GIB, free=60 * GIB, used=19 * GIB, reserved=GIB)
        return SimpleNamespace(total=80 * GIB, free=60 * GIB, used=20 * GIB)

    nv.nvmlInit = init  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        SimpleNamespace(pid=7, usedGpuMemory=10 * GIB)
    ]
    nv.nvmlDeviceGetGraphicsRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        SimpleNamespace(pid=7, usedGpuMemory=GIB),
        SimpleNamespace(pid=8, usedGpuMemory=None),
    ]
    return nv


def test_one_reading_feeds_detection_and_engine_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    (device,) = read_devices()
    assert (device.used_bytes, device.reserved_bytes) == (19 * GIB, GIB)
    assert [p.pid for p in device.processes] == [7, 7, 8]
    (detected,) = detect_gpus()
    assert detected.used_bytes == 19 * GIB and detected.reserved_bytes == GIB
    assert [p.pid for p in detected.processes] == [7, 8]  # one row per process
    (engine,) = gpu_memory() or []
    assert engine.used_bytes == 20 * GIB  # NVML's v1 "used": the driver reserve included
    assert engine.process_bytes == {7: 11 * GIB}  # compute + graphics of one process


def test_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=True))
    with pytest.raises(NvmlUnavailable) as info:
        read_devices()
    assert info.value.reason == "no_driver"
    assert gpu_memory() is None
    with pytest.raises(NoGPUDetected, match="no NVIDIA driver"):
        detect_gpus()
