"""What the plan says about context parallelism, KV offloading, sleep mode and CUDA graphs.

The memory model prices these mechanisms (docs/memory-model.md §14); this module turns a
prediction into the plan's lines about them: the host memory the KV offload pins (checked
against the host's RAM when the plan knows it), what a connector changes in the GPU pool, what
stays on each GPU while the engine sleeps, and how the CUDA-graph estimate is applied.
"""

from __future__ import annotations

from oomguard.memory.engine import MemoryPrediction
from oomguard.memory.offload import kv_connector
from oomguard.memory.sleep import sleep_footprints
from oomguard.plan.recommend import CONTEXT_RESERVE_BYTES
from oomguard.units import GIB


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def offload_notes(p: MemoryPrediction, host_memory_bytes: int | None) -> list[str]:
    """The connector's host memory (one engine, total over its ranks) and its effect on the pool."""
    s = p.settings
    connector = kv_connector(s.kv_offloading_size, s.kv_offloading_backend, s.kv_transfer_config)
    if connector is None:
        return []
    notes: list[str] = []
    hma = (
        ""
        if connector.supports_hma
        else (
            "; it does not support the hybrid KV cache manager, so vLLM turns it off "
            "(sliding-window layers keep KV for the whole context)"
        )
    )
    notes.append(f"KV connector {connector.name}: the GPU KV pool is sized as without it{hma}")
    if connector.host_bytes is None:
        notes.append(f"not priced: {connector.unpriced} (host memory not checked)")
        return notes
    engines = s.data_parallel_size
    host = connector.host_bytes * engines
    per = f" ({engines} engines × {_gib(connector.host_bytes)})" if engines > 1 else ""
    line = f"KV offload pins {_gib(host)} of host memory{per}"
    if host_memory_bytes is not None:
        verdict = "fits in" if host <= host_memory_bytes else "does NOT fit in"
        line += f": {verdict} the host's {_gib(host_memory_bytes)}"
        if host > host_memory_bytes:
            line += " (lower --kv-offloading-size)"
    notes.append(line)
    return notes


def sleep_notes(p: MemoryPrediction) -> list[str]:
    """What stays on each GPU while asleep, and the host memory each level pins."""
    if not p.settings.enable_sleep_mode:
        return []
    level1, level2 = sleep_footprints(
        weights_bytes=p.weights.value_bytes,
        non_torch_bytes=p.non_torch.value_bytes,
        non_torch_high_bytes=p.non_torch.high_bytes,
        graph_bytes=p.cudagraph.value_bytes,
        graph_high_bytes=p.cudagraph.high_bytes,
        context_bytes=CONTEXT_RESERVE_BYTES,
    )
    graphs = (
        ""
        if p.cudagraph.value_bytes or p.settings.enforce_eager
        else (" plus the CUDA graphs (not estimated for this release)")
    )
    return [
        f"sleep mode: about {_gib(level1.gpu_bytes)} (up to {_gib(level1.gpu_bytes_high)}) stays "
        f"on each GPU at either level (CUDA context, NCCL buffers, CUDA graphs){graphs}; "
        f"level 1 pins {_gib(level1.host_bytes)} of host memory per GPU for the weights, "
        "level 2 discards them (reloaded on wake)"
    ]


def graph_notes(p: MemoryPrediction) -> list[str]:
    """How the CUDA-graph estimate enters the KV budget when the settings change it."""
    s = p.settings
    if s.estimate_cudagraphs is False and p.era.cudagraph_estimate_exists and not s.enforce_eager:
        return [
            "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: the CUDA graphs are not subtracted "
            "from the KV budget and come out of the 1 − gpu_memory_utilization slack"
        ]
    return []


def feature_notes(p: MemoryPrediction, host_memory_bytes: int | None) -> list[str]:
    """Every line of this module for one prediction."""
    return [*offload_notes(p, host_memory_bytes), *sleep_notes(p), *graph_notes(p)]
