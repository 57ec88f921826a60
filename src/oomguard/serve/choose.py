"""Which engine ``oomguard serve MODEL --gguf FILE`` launches: the fallback chain decides.

vLLM serves the model when ``plan`` finds a configuration that fits this machine's device (and
serves the workload, when one is given). When none does, the chain's first tier that serves
decides, among the tiers this machine can run as it is (not more or larger GPUs, not another
checkpoint): a llama.cpp tier (the GPU/host split, or the CPU only) launches llama-server on
the GGUF; a vLLM tier (a shorter context, fp8 KV, ``--cpu-offload-gb``) is left to vLLM's own
serve, which launches the plan and heals towards it. Without a
vLLM installation the GGUF is served by llama.cpp.
"""

from __future__ import annotations

from typing import Any

from oomguard.errors import OomguardError
from oomguard.units import GIB

LLAMA_TIERS = ("llama_cpp", "cpu_only")
# tiers this machine can run as it is: not more or larger GPUs, not another checkpoint
RUNNABLE_HERE = ("shorter_context", "cpu_offload", *LLAMA_TIERS)


def choose_engine(options: Any) -> tuple[str, str]:
    """``("vllm" | "llama.cpp", why)`` for ``options`` (a :class:`ServeOptions` with a model
    and a GGUF); the plan runs on this machine's device as vLLM's serve would run it."""
    from oomguard.plan.service import plan
    from oomguard.serve.device import detect_device
    from oomguard.serve.engines import VllmEngine

    try:
        engine = VllmEngine.find(options.vllm_python)
    except OomguardError as exc:
        return "llama.cpp", f"no vLLM to launch ({exc.one_line()}): llama.cpp serves {options.gguf}"
    device = detect_device(engine.cpu_build)
    settings = dict(options.plan_settings)
    if device is not None:
        settings["platform"] = device.platform
    w = options.workload
    try:
        result = plan(
            options.model,
            device.spec if device else None,
            gpu_count=device.count if device else None,
            p99_tokens=w.p99_tokens,
            concurrency=w.concurrency,
            allow_hub=options.allow_hub,
            use_calibration=options.use_calibration,
            **settings,
        )
    except OomguardError as exc:
        return (
            "llama.cpp",
            f"plan cannot size {options.model} for vLLM ({exc.one_line()}): "
            "llama.cpp serves the GGUF",
        )
    if result.fits:
        return "vllm", "plan: vLLM holds the model on this device"
    first = next((a for a in result.alternatives if _runs_here(a, device)), None)
    if first is None:
        return "llama.cpp", (
            "plan: no tier of the fallback chain that runs on this machine serves the workload "
            "as asked; llama.cpp serves the GGUF"
        )
    if first.kind in LLAMA_TIERS:
        return (
            "llama.cpp",
            "plan: vLLM cannot hold the model here; the chain's first tier that "
            f"serves: {first.title}",
        )
    return "vllm", f"plan: the chain's first tier that serves is vLLM's: {first.title}"


def _runs_here(alternative: Any, device: Any) -> bool:
    """A tier that serves and that this machine can run as it is: within its RAM, and no
    ``--cpu-offload-gb`` where the device already is the CPU."""
    import psutil

    if not alternative.serves_workload or alternative.kind not in RUNNABLE_HERE:
        return False
    if alternative.kind == "cpu_offload" and (device is None or device.platform == "cpu"):
        return False
    host_gib = alternative.numbers.get("host_gib")
    return not (
        isinstance(host_gib, (int, float)) and host_gib * GIB > psutil.virtual_memory().total
    )
