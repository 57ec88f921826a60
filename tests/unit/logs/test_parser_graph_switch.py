"""The CUDA-graph estimate as vLLM states it with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on
and off (docs/memory-model.md §2.6, §14.4; vllm 0.32 v1/worker/gpu_worker.py)."""

from __future__ import annotations

import pytest

from oomguard.logs import parse_stream

# the device total comes from the OOM report (the hint states fractions of it)
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
    "capacity of 79.19 GiB of which 1.00 MiB is free."
)


def test_switched_off_warning_states_the_estimate_and_that_it_was_not_applied() -> None:
    p = parse_stream(
        [
            "WARNING CUDA graph memory profiling is disabled "
            "(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, CUDA graph memory is not "
            "accounted for during KV cache allocation, which may require lowering "
            "--gpu-memory-utilization to avoid OOM. Consider re-enabling it (the default as of "
            "v0.21.0) and increasing --gpu-memory-utilization from 0.9200 to 0.9306.",
            OOM,
        ]
    )
    assert p.get("cudagraph_estimate_applied") == 0
    assert p.get("cudagraph_estimate_gib") == pytest.approx((0.9306 - 0.92) * 79.19)


def test_enabled_hint_marks_the_estimate_applied() -> None:
    p = parse_stream(
        [
            "INFO CUDA graph memory profiling is enabled (default since v0.21.0). The current "
            "--gpu-memory-utilization=0.9200 is equivalent to --gpu-memory-utilization=0.9094 "
            "without CUDA graph memory profiling.",
            "INFO CUDA graph pool memory: 0.74 GiB (actual), 0.84 GiB (estimated), "
            "difference: 0.1 GiB (13.5%).",
            OOM,
        ]
    )
    assert p.get("cudagraph_estimate_applied") == 1
    assert p.get("cudagraph_actual_gib") == pytest.approx(0.74)
    assert p.get("cudagraph_estimate_gib") == pytest.approx(0.84)
