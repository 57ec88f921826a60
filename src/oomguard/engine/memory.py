"""What an engine's processes hold: host memory (psutil) and GPU memory (NVML, where present).

NVML is the only source of per-process GPU figures, and it is unreliable in places: inside a
container it reports host PIDs (so no PID of ours matches), and some drivers report wrong
per-process figures. Callers therefore get whole-device figures beside the per-process ones,
and a ``source`` that says which they can trust.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

from oomguard.facts.nvml import NvmlDevice, NvmlUnavailable, read_devices


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's memory as NVML reports it."""

    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    process_bytes: dict[int, int] = field(default_factory=dict)  # pid → bytes, as reported


def host_rss_bytes(pids: Iterable[int]) -> int:
    """Resident host memory of ``pids`` together (processes that are gone count 0)."""
    total = 0
    for pid in pids:
        try:
            total += int(psutil.Process(pid).memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (alive now)."""
    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def gpu_memory() -> list[DeviceMemory] | None:
    """Every GPU's memory and per-process use via NVML; None where NVML is unavailable."""
    try:
        devices = read_devices()
    except NvmlUnavailable:
        return None
    return [_device_memory(d) for d in devices]


def _device_memory(device: NvmlDevice) -> DeviceMemory:
    per_process: dict[int, int] = {}
    for p in device.processes:
        if p.used_bytes is not None:
            per_process[p.pid] = per_process.get(p.pid, 0) + p.used_bytes
    return DeviceMemory(
        index=device.index,
        name=device.name,
        total_bytes=device.total_bytes,
        used_bytes=device.used_bytes + device.reserved_bytes,
        free_bytes=device.free_bytes,
        process_bytes=per_process,
    )


@dataclass(frozen=True)
class Release:
    """How the memory of a stopped engine was seen to come back."""

    released: bool
    waited_s: float
    source: str  # "nvml-process", "nvml-device", "process-exit"
    detail: str


def wait_memory_released(
    pids: Iterable[int],
    *,
    timeout_s: float = 60.0,
    used_before_start: dict[int, int] | None = None,
    poll_s: float = 0.2,
) -> Release:
    """Wait until the memory ``pids`` held is free again.

    Host memory is free once the processes are gone. On NVIDIA GPUs the driver frees device
    memory a little after the process exits: wait until no pid of ours is listed by NVML; when
    NVML lists none of ours at all (containers report host PIDs), wait instead until each
    device's used memory is back to ``used_before_start`` (+256 MiB for other tenants' drift).
    """
    wanted = set(pids)
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and _alive(p) for p in wanted):
        time.sleep(poll_s)
    if any(psutil.pid_exists(p) and _alive(p) for p in wanted):
        return Release(False, time.monotonic() - started, "process-exit", "processes still alive")
    devices = gpu_memory()
    if devices is None:
        return Release(True, time.monotonic() - started, "process-exit", "no NVML: host memory")
    while time.monotonic() < deadline:
        devices = gpu_memory() or []
        ours = [d.index for d in devices if wanted & set(d.process_bytes)]
        if ours:
            time.sleep(poll_s)
            continue
        if used_before_start is None:
            return Release(
                True,
                time.monotonic() - started,
                "nvml-process",
                "no process of the engine listed by NVML",
            )
        high = [
            d.index
            for d in devices
            if d.used_bytes > used_before_start.get(d.index, d.used_bytes) + (256 << 20)
        ]
        if not high:
            return Release(
                True,
                time.monotonic() - started,
                "nvml-device",
                "device memory back to its level before the start",
            )
        time.sleep(poll_s)
    return Release(False, time.monotonic() - started, "nvml-device", "device memory still held")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
