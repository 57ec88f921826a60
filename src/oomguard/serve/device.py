"""The memory vLLM will size its pool from, read on this machine before a launch.

On NVIDIA GPUs that is the GPU (NVML: the catalogue spec, the free memory). The CPU build of
vLLM sizes its pool in host RAM instead: the NUMA node of the worker's first CPU, with
``MemTotal`` as the total and ``MemFree + Active(file) + Inactive(file) + SReclaimable`` as
the available memory, both clamped to a cgroup memory limit (vllm 0.32
``utils/cpu_resource_utils.get_memory_node_info``). Reading them the same way makes the
prediction and vLLM's own free-memory check agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from oomguard.memory.spec import GPUSpec
from oomguard.units import GIB


@dataclass(frozen=True)
class Device:
    """What one engine rank sizes its memory against, as the memory model takes it."""

    spec: GPUSpec  # a GPU, or the CPU NUMA node (vendor "cpu")
    platform: str  # "cuda" | "cpu"
    free_bytes: int | None  # free (GPU) or available (CPU node) memory right now
    count: int = 1  # GPUs on this machine
    source: str = ""

    @property
    def name(self) -> str:
        """The name calibration observations are stored under."""
        return self.spec.name

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary."""
        return {
            "name": self.spec.name,
            "platform": self.platform,
            "total_gib": round(self.spec.total_bytes / GIB, 3),
            "free_gib": None if self.free_bytes is None else round(self.free_bytes / GIB, 3),
            "count": self.count,
            "source": self.source,
        }


def detect_device(cpu_build: bool) -> Device | None:
    """The device a launch will use: the CPU node for a CPU build of vLLM, else the first GPU
    NVML lists; None when neither can be read (the launch goes on without a prediction)."""
    if cpu_build:
        return cpu_node_device()
    from oomguard.errors import OomguardError
    from oomguard.facts.gpus import detect_gpus

    try:
        gpus = detect_gpus()
    except OomguardError:
        return None
    first = gpus[0]
    return Device(
        spec=first.spec,
        platform="cuda",
        free_bytes=min(g.free_bytes for g in gpus),
        count=len(gpus),
        source="nvml",
    )


def refreshed(device: Device) -> Device:
    """``device`` read again now (same name): the CPU node's total and available memory can
    move between launches (a VM's balloon, other processes), a GPU's free memory too."""
    from dataclasses import replace

    if device.platform == "cpu":
        read = _node_memory(_first_cpu_node())
        if read is None:
            return device
        total, available, _ = read
        return replace(device, spec=replace(device.spec, total_bytes=total), free_bytes=available)
    free = gpu_free_bytes()
    return device if free is None else replace(device, free_bytes=free)


def gpu_free_bytes() -> int | None:
    """The smallest free memory over this machine's GPUs right now (NVML), or None."""
    from oomguard.engine import gpu_memory

    devices = gpu_memory()
    return min(d.free_bytes for d in devices) if devices else None


def cpu_node_device() -> Device | None:
    """The CPU build's device: the NUMA node of the first CPU this process may run on."""
    node = _first_cpu_node()
    read = _node_memory(node)
    if read is None:
        return None
    total, available, source = read
    spec = GPUSpec(
        name=f"CPU node {node}",
        total_bytes=total,
        marketing_gb=round(total / 1e9, 1),
        vendor="cpu",
        source=source,
    )
    return Device(spec=spec, platform="cpu", free_bytes=available, source=source)


def _first_cpu_node() -> int:
    try:
        cpu = min(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError):
        return 0
    for entry in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"):
        suffix = entry.name[4:]
        if suffix.isdigit():
            return int(suffix)
    return 0


def _node_memory(node: int) -> tuple[int, int, str] | None:
    """(total, available, source) of NUMA ``node``, clamped to the cgroup limit."""
    path = Path(f"/sys/devices/system/node/node{node}/meminfo")
    info: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.split()  # "Node 0 MemTotal:       11757772 kB"
            if len(parts) >= 4:
                info[parts[2].rstrip(":")] = int(parts[3]) * 1024
        total = info["MemTotal"]
        available = (
            info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
        )
        source = f"{path}"
    except (OSError, KeyError, ValueError):
        import psutil

        memory = psutil.virtual_memory()
        total, available, source = int(memory.total), int(memory.available), "psutil"
    limit, usage = _cgroup_memory()
    if limit is not None and limit < total:
        total = limit
        available = max(0, min(available, limit - (usage or 0)))
        source += " (cgroup limit)"
    return total, available, source


def _cgroup_memory() -> tuple[int | None, int | None]:
    """The cgroup's memory limit and usage (v2, else v1), None where there is none."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if not text.isdigit() or int(text) >= 2**60:
            return None, None
        try:
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            usage = None
        return int(text), usage
    return None, None
