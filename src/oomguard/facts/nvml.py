"""The one NVML reader: every NVIDIA GPU's memory and the processes using it.

``pynvml`` (nvidia-ml-py) is imported on first use only, so a machine without it or without a
driver costs nothing until a caller asks. Each call initialises NVML, reads every device and
shuts NVML down again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class NvmlUnavailable(Exception):  # noqa: N818 - a state, not an error of the caller
    """NVML cannot be read here; ``reason`` is "not_installed", "no_driver" or "failed"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class NvmlProcess:
    """One process NVML lists on a device (compute or graphics), as reported."""

    pid: int
    used_bytes: int | None  # None where the driver does not report it


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML reports it.

    ``used_bytes`` is NVML's v2 figure where the driver has it (driver reserve excluded,
    ``reserved_bytes`` beside it), else the v1 figure with ``reserved_bytes`` 0; so
    ``used_bytes + reserved_bytes`` is the v1 "used" either way.
    """

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    reserved_bytes: int
    processes: tuple[NvmlProcess, ...]  # compute processes first, then graphics


def read_devices() -> list[NvmlDevice]:
    """Every device NVML sees (possibly none); raises :class:`NvmlUnavailable`."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("not_installed", "nvidia-ml-py is not installed") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlUnavailable("no_driver", str(exc)) from None
    try:
        return [_read_one(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception as exc:  # noqa: BLE001 - a device that stops answering
        raise NvmlUnavailable("failed", str(exc)) from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - nothing to do about a failed shutdown
            pass


def _read_one(nv: Any, index: int) -> NvmlDevice:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    name = nv.nvmlDeviceGetName(handle)
    reserved = 0
    try:
        mem = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
        reserved = int(getattr(mem, "reserved", 0) or 0)
    except Exception:  # noqa: BLE001 - older drivers: v1 only
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
    procs: list[NvmlProcess] = []
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            for p in getattr(nv, getter)(handle):
                used = getattr(p, "usedGpuMemory", None)
                procs.append(NvmlProcess(int(p.pid), int(used) if used is not None else None))
        except Exception:  # noqa: BLE001, S112 - not supported on this device or driver
            continue
    return NvmlDevice(
        index=index,
        name=name.decode() if isinstance(name, bytes) else str(name),
        total_bytes=int(mem.total),
        free_bytes=int(mem.free),
        used_bytes=int(mem.used),
        reserved_bytes=reserved,
        processes=tuple(procs),
    )
