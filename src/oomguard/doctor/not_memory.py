"""Engine failures that are not memory: what they are, why memory is not the cause, what to do.

The log catalogue recognises them (``logs.catalogue.NOT_MEMORY_FAILURES``): a process killed
by an illegal instruction (SIGILL), a CUDA build without kernels for this GPU, a driver older
than the CUDA the wheels were built with, NCCL failing to set up its communicator. The engine
dies the same way whatever memory it is given, so the doctor names them instead of a memory
cause and serve stops instead of healing or restarting into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomguard.logs import Evidence, ParsedLog
from oomguard.logs.catalogue import not_memory_failures


@dataclass(frozen=True)
class FaultKind:
    """One kind of failure that is not memory: a short label, what happened, why no memory
    setting changes it, and what to do, in the order to try."""

    label: str
    summary: str
    why: str
    actions: tuple[str, ...]


KINDS: dict[str, FaultKind] = {
    "illegal_instruction": FaultKind(
        "illegal instruction (SIGILL)",
        "a process of the engine was killed by an illegal instruction (SIGILL)",
        "The CPU refused an instruction a kernel was compiled or dispatched for: the build "
        "expects an instruction set (AMX, AVX-512 BF16, AVX-512) that this CPU, or the virtual "
        "machine in front of it, does not provide. The same request dies the same way with any "
        "memory setting.",
        (
            "on vLLM's CPU backend run the model in float32 (--dtype float32): the bf16 "
            "attention and matmul kernels (AMX, AVX-512 BF16) are then not used",
            "check which instruction sets the engine sees (lscpu, /proc/cpuinfo flags) and "
            "whether the hypervisor enables them (AMX needs the guest kernel's permission)",
            "install a build made for this CPU",
        ),
    ),
    "no_kernel_image": FaultKind(
        "no kernel image for this GPU",
        "the CUDA build has no kernel for this GPU's compute capability",
        "PyTorch, vLLM or a kernel library was compiled for other GPU architectures than this "
        "one (a new GPU with an older wheel, or an old GPU a newer wheel dropped). No memory "
        "setting loads a kernel that was never built.",
        (
            "install PyTorch and vLLM builds compiled for this GPU's compute capability "
            "(python -c 'import torch; print(torch.cuda.get_arch_list())' lists the built ones)",
            "or build vLLM from source with TORCH_CUDA_ARCH_LIST set to this GPU's capability",
            "a quantization or attention backend may lack kernels for this GPU: try another",
        ),
    ),
    "cuda_driver_too_old": FaultKind(
        "NVIDIA driver older than the CUDA build",
        "the NVIDIA driver is older than the CUDA version PyTorch / vLLM were built with",
        "CUDA refuses to start when the driver does not support the runtime the wheels carry; "
        "nothing is allocated yet, so memory settings do not matter.",
        (
            "upgrade the NVIDIA driver (nvidia-smi shows the newest CUDA version it supports)",
            "or install PyTorch / vLLM wheels built for a CUDA version the driver supports "
            "(python -c 'import torch; print(torch.version.cuda)' shows the installed one)",
        ),
    ),
    "nccl_init_failed": FaultKind(
        "NCCL failed to initialise",
        "NCCL could not set up the communicator between the engine's ranks",
        "The ranks could not connect (shared-memory, P2P or InfiniBand transport, the network "
        "interface, mismatched NCCL libraries); it fails before the KV cache exists, so memory "
        "settings do not change it.",
        (
            "rerun with NCCL_DEBUG=INFO: the lines before the error name the transport that failed",
            "in a container, run it with --ipc=host (or a larger --shm-size)",
            "try NCCL_P2P_DISABLE=1 (or NCCL_IB_DISABLE=1), or set NCCL_SOCKET_IFNAME to the "
            "interface the ranks share",
        ),
    ),
}


@dataclass(frozen=True)
class EngineFault:
    """A failure the log shows that is not memory: its kind (a key of :data:`KINDS`) and the
    line that shows it."""

    kind: str
    evidence: Evidence

    @property
    def info(self) -> FaultKind:
        """The label, summary, reason and actions of this kind."""
        return KINDS[self.kind]

    def one_line(self) -> str:
        """``illegal instruction (SIGILL): not memory; <first action>``."""
        return f"{self.info.label}: not a memory failure; {self.info.actions[0]}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "label": self.info.label,
            "summary": self.info.summary,
            "why": self.info.why,
            "actions": list(self.info.actions),
            "evidence": self.evidence.to_dict(),
        }


def engine_fault(parsed: ParsedLog) -> EngineFault | None:
    """The first failure that is not memory in ``parsed`` (by its line), or None."""
    found = not_memory_failures(parsed.signatures)
    if not found:
        return None
    kind, evidence = min(found.items(), key=lambda item: item[1].line)
    return EngineFault(kind, evidence)
