"""The estimated terms: mechanisms counted from vLLM's code, and the ranges every estimate
carries."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomguard.memory.activation import (
    activation_peak,
    sampler_bytes_per_logit,
    sampler_path_for,
    sampler_peak_bytes,
)
from oomguard.memory.engine import EngineSettings, MeasuredTerms, predict
from oomguard.memory.spec import GPUSpec
from oomguard.memory.versions import resolve_era

from .builders import llama_3_1_8b

GIB = 2**30
H100 = GPUSpec(
    "H100 SXM",
    int(79.19 * GIB),
    80,
    compute_capability="9.0",
    device_name="NVIDIA H100 80GB HBM3",
    nvls=True,
)


def test_sampler_bytes_are_counted_from_the_implementation() -> None:
    # bf16 logits + fp32 copy + sort values/indices + iota + CUB double buffers
    assert sampler_bytes_per_logit("sort", 2) == 2 + 4 + 12 + 8 + 12 == 38
    # bf16 logits + fp32 copy + softmax probabilities + exponential noise
    assert sampler_bytes_per_logit("triton", 2) == sampler_bytes_per_logit("flashinfer", 2) == 14
    assert sampler_bytes_per_logit("sort", 4) == 40  # an fp32 model's logits are wider


@pytest.mark.parametrize(
    ("version", "engine", "rows", "path", "alternative"),
    [
        ("0.7", "v0", 256, "sort", None),
        ("0.11", "v1", 1024, "sort", "flashinfer"),
        ("0.14", "v1", 1024, "sort", None),
        ("0.16", "v1", 1024, "sort", None),
        ("0.17", "v1", 1024, "triton", None),
        ("0.33", "v1", 1024, "triton", None),
        ("0.33", "v1", 4, "sort", None),
    ],
)
def test_which_sampler_runs_by_release(
    version: str, engine: str, rows: int, path: str, alternative: str | None
) -> None:
    assert sampler_path_for(resolve_era(version, engine), rows) == (path, alternative)


def test_logged_sampler_peaks_fall_inside_the_band() -> None:
    """Llama-3.1-8B on an H100, T = 8192, R = 1024: 4.76 GiB logged on 0.11 (sort), 1.89 GiB on
    0.19 (Triton) (development logs, llm-d sources)."""
    model = llama_3_1_8b()
    for version, logged in (("0.11", 4.76), ("0.19", 1.89)):
        value, low, high, _ = sampler_peak_bytes(model, 1024, resolve_era(version), 2, 8192)
        assert abs(value / GIB - logged) / logged < 0.05  # counted, not fitted
        assert low <= value <= high  # the span of the implementations the release may run
        peak = activation_peak(
            model,
            era=resolve_era(version),
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
            tp=1,
            dtype_bytes=2,
        )
        assert peak.low_bytes / GIB <= logged <= peak.high_bytes / GIB  # with the era's band


def test_flashinfer_or_sort_release_widens_the_low_end() -> None:
    model = llama_3_1_8b()
    kw = dict(max_num_batched_tokens=8192, max_num_seqs=1024, tp=1, dtype_bytes=2)
    v011 = activation_peak(model, era=resolve_era("0.11"), **kw)
    v014 = activation_peak(model, era=resolve_era("0.14"), **kw)
    assert v011.value_bytes == v014.value_bytes  # the sort is the point estimate in both
    assert v011.low_bytes < v014.low_bytes * 0.5  # FlashInfer's 14 B/logit is possible on 0.11
    assert "flashinfer" in v011.basis


def test_v0_forward_holds_one_intermediate_buffer_fewer() -> None:
    model = llama_3_1_8b()
    kw = dict(max_num_batched_tokens=20000, max_num_seqs=1, tp=1, dtype_bytes=2, has_sampler=False)
    v0 = activation_peak(model, era=resolve_era("0.6.4", "v0"), **kw)
    v1 = activation_peak(model, era=resolve_era("0.19"), **kw)
    per_token_diff = (v1.value_bytes - v0.value_bytes) / 20000 / 2
    assert per_token_diff == pytest.approx(model.intermediate_size, rel=1e-6)
    # Llama-3.1-8B at T = 20,000 on V0: 2.07 GiB logged (vllm#10517)
    assert v0.low_bytes / GIB <= 2.07 <= v0.high_bytes / GIB


def test_kv_range_brackets_the_value_and_follows_the_terms() -> None:
    p = predict(
        llama_3_1_8b(), H100, EngineSettings(vllm_version="0.19", gpu_memory_utilization=0.95)
    )
    low, high = p.kv_cache_bytes_range
    assert low < p.kv_cache_bytes < high
    spread = sum(
        e.high_bytes - e.low_bytes for e in (p.weights, p.activation, p.non_torch, p.cudagraph)
    )
    assert high - low == pytest.approx(spread, abs=2)
    t_low, t_high = p.kv_cache_tokens_range
    assert t_low < p.kv_cache_tokens < t_high
    c_low, c_high = p.max_concurrency_range
    assert c_low < p.max_concurrency < c_high
    # Llama-3.1-8B on an H100, 0.19, util 0.95: 58.11 GiB logged (development logs)
    assert low / GIB <= 58.11 <= high / GIB


def test_measured_terms_and_fixed_budgets_have_no_spread() -> None:
    settings = EngineSettings(vllm_version="0.19", gpu_memory_utilization=0.95)
    measured = MeasuredTerms(
        weights_bytes=15 * GIB, activation_bytes=2 * GIB, non_torch_bytes=GIB // 4, source="log"
    )
    p = predict(llama_3_1_8b(), H100, settings, measured=measured)
    assert p.kv_cache_bytes_range == (p.kv_cache_bytes, p.kv_cache_bytes)
    fixed = predict(llama_3_1_8b(), H100, replace(settings, kv_cache_memory_bytes=20 * GIB))
    assert fixed.kv_cache_bytes_range == (20 * GIB, 20 * GIB)
    assert fixed.kv_cache_tokens_range[0] == fixed.kv_cache_tokens_range[1]


def test_graph_estimate_carries_a_wider_band_under_tensor_parallelism() -> None:
    one = predict(llama_3_1_8b(), H100, EngineSettings(vllm_version="0.28"))
    two = predict(llama_3_1_8b(), H100, EngineSettings(vllm_version="0.28", tensor_parallel_size=2))
    assert (two.cudagraph.high_bytes - two.cudagraph.value_bytes) > (
        one.cudagraph.high_bytes - one.cudagraph.value_bytes
    )


def test_plan_json_reports_the_ranges() -> None:
    from oomguard.plan.service import plan

    data = plan("meta-llama/Llama-3.1-8B-Instruct", "L40S", allow_hub=False).to_dict()
    low, high = data["memory"]["kv_cache_gib_range"]
    assert low < data["memory"]["kv_cache_gib"] < high
    t_low, t_high = data["kv_cache_tokens_range"]
    assert t_low < data["kv_cache_tokens"] < t_high
    for term in ("activation", "non_torch", "cudagraph"):
        est = data["estimates"][term]
        assert est["low_gib"] <= est["value_gib"] <= est["high_gib"]
