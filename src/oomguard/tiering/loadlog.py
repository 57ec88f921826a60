"""Read what llama-server prints while it loads: buffers per device, context, and failures.

The lines are printed by ``llama-model.cpp`` (``%12s model buffer size = %8.2f MiB``),
``llama-kv-cache.cpp`` (``%10s KV buffer size``), ``llama-context.cpp`` (``%10s  output buffer
size``, ``%10s compute buffer size``, ``n_ctx = …``) and the allocators' failure messages.
A buffer's name is its buffer type: ``CPU``, ``CPU_Mapped`` and ``CPU_REPACK`` (host memory,
the CPU backend), ``CUDA_Host`` (pinned host memory), ``CUDA0``/``ROCm0``/``Vulkan0``/``RPC0[…]``
(GPU devices, numbered in order of appearance). Sizes are printed to 0.01 MiB, so an observed
size is known to ±0.005 MiB.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from oomguard.units import MIB

PRINT_RESOLUTION_BYTES = int(0.005 * MIB) + 1  # "%8.2f MiB" rounds to 0.01 MiB

_BUFFER = re.compile(
    r"(?P<name>\S+)\s+(?P<kind>model|KV|output|compute) buffer size\s*=\s*(?P<mib>[\d.]+) MiB"
)
_CONTEXT = re.compile(
    r"llama_context:\s+(?P<key>n_ctx|n_ctx_seq|n_seq_max|n_batch|n_ubatch|flash_attn|kv_unified)"
    r"\s+=\s+(?P<value>\S+)"
)
_OFFLOADED = re.compile(r"offloaded (?P<n>\d+)/(?P<of>\d+) layers to GPU")
_FAILURES = (
    re.compile(r"failed to allocate (?P<name>\S+) buffer of size (?P<bytes>\d+)"),
    re.compile(r"unable to allocate (?P<name>\S+) buffer"),
    re.compile(r"(?P<name>cudaMalloc|hipMalloc) failed: out of memory"),
    re.compile(r"failed to allocate compute (?P<name>pp|tg) buffers"),
    re.compile(r"failed to allocate buffer for kv cache"),
    re.compile(r"failed to allocate (?P<name>\S+) buffer for graph"),
)
_HOST_NAMES = ("CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host", "ROCm_Host", "Vulkan_Host", "AMX")


def device_of_buffer(name: str, gpu_order: list[str]) -> str:
    """``CPU`` for host buffer types, ``GPUn`` for the n-th GPU buffer name seen."""
    if name in _HOST_NAMES or name.endswith("_Host") or name.startswith("CPU"):
        return "CPU"
    if name not in gpu_order:
        gpu_order.append(name)
    return f"GPU{gpu_order.index(name)}"


@dataclass(frozen=True)
class ObservedBuffer:
    """One ``… buffer size = X MiB`` line."""

    kind: str  # "model" | "kv" | "output" | "compute"
    name: str  # the buffer type as printed ("CPU_Mapped", "CUDA0")
    device: str  # "CPU" | "GPU0" | ...
    size_bytes: int  # X MiB in bytes (known to ±PRINT_RESOLUTION_BYTES)


@dataclass
class LoadLog:
    """Everything read from a llama-server load log."""

    buffers: list[ObservedBuffer] = field(default_factory=list)
    context: dict[str, str] = field(default_factory=dict)
    offloaded_layers: tuple[int, int] | None = None
    failures: list[str] = field(default_factory=list)
    gpu_names: list[str] = field(default_factory=list)

    def total(self, kind: str, device: str) -> int | None:
        """Sum of the printed ``kind`` buffers on ``device`` (None when none was printed)."""
        sizes = [b.size_bytes for b in self.buffers if b.kind == kind and b.device == device]
        return sum(sizes) if sizes else None

    @property
    def allocation_failed(self) -> bool:
        """Whether the log shows a buffer llama.cpp could not allocate."""
        return bool(self.failures)

    def feed(self, line: str) -> None:
        """Read one more line (usable as an ``EngineProcess`` line callback)."""
        m = _BUFFER.search(line)
        if m:
            kind = m.group("kind").lower()
            name = m.group("name")
            size = round(float(m.group("mib")) * MIB)
            self.buffers.append(
                ObservedBuffer(kind, name, device_of_buffer(name, self.gpu_names), size)
            )
            return
        m = _CONTEXT.search(line)
        if m:
            self.context.setdefault(m.group("key"), m.group("value"))
            return
        m = _OFFLOADED.search(line)
        if m:
            self.offloaded_layers = (int(m.group("n")), int(m.group("of")))
            return
        for pattern in _FAILURES:
            if pattern.search(line):
                self.failures.append(line.strip())
                return


def parse_load_log(lines: Iterable[str]) -> LoadLog:
    """A :class:`LoadLog` of all ``lines``."""
    log = LoadLog()
    for line in lines:
        log.feed(line)
    return log
