"""Write what a run measured into the calibration store: the pool (KV tokens, bytes per token),
the most peak requests it held without a preemption, and the prefix-cache hit rate over the
stages (:mod:`oomguard.calibration.prefix`), under the store's usual key (GPU, vLLM version,
model family, TP, PP)."""

from __future__ import annotations

from typing import Any

from oomguard.bench.runner import BenchResult
from oomguard.units import GIB


def record_run(
    result: BenchResult, *, gpu: str | None, tp: int = 1, pp: int = 1, store_path: Any = None
) -> dict[str, Any]:
    """Store what the run measured; returns what was stored, or why nothing was.

    The GPU comes from ``gpu`` (``--gpu``) or NVML's first device when the server is on this
    machine; the version from the server's ``/version``. The capacity needs a safe point and a
    stated pool; the hit rate needs vLLM's prefix-cache counters to have moved (prefix caching
    on, prompts admitted). Nothing is stored without a GPU name or a version.
    """
    from oomguard.calibration import StartupMeasurement, Store, catalogue_gpu_name, model_family
    from oomguard.calibration.prefix import window_fields

    info = result.server
    cap = info.capacity if result.max_safe_concurrency else None
    window = result.prefix_cache if result.prefix_cache and result.prefix_cache.queries else None
    missing = []
    if cap is None and window is None:
        if not result.max_safe_concurrency:
            missing.append("no safe concurrency was found")
        if info.capacity is None:
            missing.append("the server does not state its KV pool")
        missing.append("no prefix-cache lookups were counted")
    gpu_name = gpu or _local_gpu_name(result)
    if not gpu_name:
        missing.append("the GPU is unknown (pass --gpu)")
    if not info.vllm_version:
        missing.append("the server does not state a vLLM version (/version)")
    if missing:
        return {"stored": False, "why": "; ".join(missing)}
    assert gpu_name is not None and info.vllm_version is not None
    capacity: dict[str, Any] = {}
    if cap is not None:
        capacity = {
            "kv_tokens": cap.kv_cache_tokens or cap.usable_tokens,
            "available_kv_gib": cap.kv_cache_memory_bytes / GIB
            if cap.kv_cache_memory_bytes
            else None,
            "max_safe_concurrency": result.max_safe_concurrency,
            "bench_sequence_tokens": result.settings.workload.longest_sequence_tokens(),
            "kv_bytes_per_token": cap.kv_bytes_per_token,
        }
    obs = StartupMeasurement(
        gpu=catalogue_gpu_name(gpu_name),
        vllm_version=info.vllm_version,
        model=info.model,
        family=model_family(info.model),
        tp=tp,
        pp=pp,
        gpu_raw=gpu_name,
        source=f"bench {info.url} ({result.conditions.get('workload', '')})",
        engine="V1",
        **capacity,
        **window_fields(window),
    )
    store = Store(store_path) if store_path else Store()
    store.add([obs])
    return {
        "stored": True,
        "path": str(store.path),
        "key": obs.key,
        "kv_tokens": obs.kv_tokens,
        "max_safe_concurrency": obs.max_safe_concurrency,
        "prefix_cache": None if window is None else window.to_dict(),
    }


def _local_gpu_name(result: BenchResult) -> str | None:
    if not result.server.local:
        return None
    from oomguard.engine import gpu_memory

    devices = gpu_memory()
    return devices[0].name if devices else None
