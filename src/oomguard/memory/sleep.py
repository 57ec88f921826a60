"""Sleep mode (``--enable-sleep-mode``): what stays on each GPU while the engine sleeps (§14.3).

Facts from vllm 0.32:
- ``v1/worker/gpu_worker.py`` ``_maybe_get_memory_pool_context``: with sleep mode the weights,
  the KV cache, the workspace and the KV-init ("runtime") tensors are allocated in the cuMem
  pool under those tags; the CUDA graphs join it (tag "cudagraph") only with
  ``--sleep-mode-offload-cudagraph`` (``config/vllm.py`` ``use_cumem_cudagraph_pool``).
- ``device_allocator/sleep_mode_backend.py`` ``CuMemBackend.suspend``: level 1 backs up
  "weights", "runtime" and "cudagraph" to pinned host memory and frees them; level 2 backs up
  "runtime" and "cudagraph" only (weights are reloaded on wake). Everything else in the pool
  (the KV cache, the workspace) is discarded at both levels.
- What the pool never held stays on the GPU at every level: the CUDA context, NCCL buffers
  (``ncclCommSuspend`` only with ``--enable-nccl-comm-suspend``), and the CUDA-graph pool
  unless it is offloaded. ``gpu_worker.sleep`` logs "Sleep mode freed %s GiB memory, %s GiB
  memory is still in use.".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SleepFootprint:
    """One sleep level: bytes left on each GPU and pinned host memory per rank."""

    level: int
    gpu_bytes: int
    gpu_bytes_high: int  # with every estimated term at the top of its range
    host_bytes: int


def sleep_footprints(
    *,
    weights_bytes: int,
    non_torch_bytes: int,
    non_torch_high_bytes: int,
    graph_bytes: int,
    graph_high_bytes: int,
    context_bytes: int,
    offload_cudagraph: bool = False,
) -> tuple[SleepFootprint, SleepFootprint]:
    """Levels 1 and 2 for one rank. ``graph_bytes`` is the graph pool the engine captures;
    ``context_bytes`` the CUDA context (an estimate the caller supplies)."""
    kept_graphs, kept_graphs_high = (0, 0) if offload_cudagraph else (graph_bytes, graph_high_bytes)
    gpu = context_bytes + non_torch_bytes + kept_graphs
    gpu_high = context_bytes + non_torch_high_bytes + kept_graphs_high
    host_graphs = graph_bytes if offload_cudagraph else 0
    return (
        SleepFootprint(1, gpu, gpu_high, weights_bytes + host_graphs),
        SleepFootprint(2, gpu, gpu_high, host_graphs),
    )
