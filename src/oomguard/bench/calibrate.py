"""Write what a run measured into the calibration store: the pool (KV tokens, bytes per token)
and the most peak requests it held without a preemption, under the store's usual key (GPU,
vLLM version, model family, TP, PP)."""

from __future__ import annotations

from typing import Any

from oomguard.bench.runner import BenchResult
from oomguard.units import GIB


def record_capacity(
    result: BenchResult, *, gpu: str | None, tp: int = 1, pp: int = 1, store_path: Any = None
) -> dict[str, Any]:
    """Store the run's capacity; returns what was stored, or why nothing was.

    The GPU comes from ``gpu`` (``--gpu``) or NVML's first device when the server is on this
    machine; the version from the server's ``/version``. Nothing is stored without a safe
    point, a stated pool, a GPU name or a version.
    """
    from oomguard.calibration import StartupMeasurement, Store, catalogue_gpu_name, model_family

    info = result.server
    cap = info.capacity
    missing = []
    if not result.max_safe_concurrency:
        missing.append("no safe concurrency was found")
    if cap is None:
        missing.append("the server does not state its KV pool")
    gpu_name = gpu or _local_gpu_name(result)
    if not gpu_name:
        missing.append("the GPU is unknown (pass --gpu)")
    if not info.vllm_version:
        missing.append("the server does not state a vLLM version (/version)")
    if missing:
        return {"stored": False, "why": "; ".join(missing)}
    assert cap is not None and gpu_name is not None and info.vllm_version is not None
    obs = StartupMeasurement(
        gpu=catalogue_gpu_name(gpu_name),
        vllm_version=info.vllm_version,
        model=info.model,
        family=model_family(info.model),
        tp=tp,
        pp=pp,
        gpu_raw=gpu_name,
        kv_tokens=cap.kv_cache_tokens or cap.usable_tokens,
        available_kv_gib=(cap.kv_cache_memory_bytes / GIB) if cap.kv_cache_memory_bytes else None,
        source=f"bench {info.url} ({result.conditions.get('workload', '')})",
        max_safe_concurrency=result.max_safe_concurrency,
        bench_sequence_tokens=result.settings.workload.longest_sequence_tokens(),
        kv_bytes_per_token=cap.kv_bytes_per_token,
        engine="V1",
    )
    store = Store(store_path) if store_path else Store()
    store.add([obs])
    return {
        "stored": True,
        "path": str(store.path),
        "key": obs.key,
        "kv_tokens": obs.kv_tokens,
        "max_safe_concurrency": obs.max_safe_concurrency,
    }


def _local_gpu_name(result: BenchResult) -> str | None:
    if not result.server.local:
        return None
    from oomguard.engine import gpu_memory

    devices = gpu_memory()
    return devices[0].name if devices else None
