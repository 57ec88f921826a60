"""The recommendation search, fallbacks, sizing table and the JSON surface, on real catalogue
facts."""

from __future__ import annotations

import json

import pytest

from oomguard.facts.gpus import find_gpu
from oomguard.facts.resolve import resolve_model
from oomguard.memory.engine import predict
from oomguard.plan.recommend import valid_tp_sizes
from oomguard.plan.service import plan

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"


def _independent_concurrency(result, p99: int) -> float:
    """Re-price the recommended configuration from scratch at max_model_len = P99."""
    c = result.plan
    settings = c.settings
    if settings.max_model_len != p99:
        import dataclasses

        settings = dataclasses.replace(settings, max_model_len=p99)
    pred = predict(c.model, find_gpu(c.gpu.name), settings)
    assert pred.fits
    return float(pred.max_concurrency)


@pytest.mark.parametrize(
    ("model", "gpu", "p99", "conc"),
    [
        (LLAMA_8B, "L4", 8192, 16),
        (LLAMA_8B, "A100 80GB", 32768, 24),
        ("Qwen/Qwen2.5-7B-Instruct", "RTX 4090", 4096, 8),
        ("google/gemma-2-27b", "H100", 4096, 16),
    ],
)
def test_recommendation_serves_the_workload_when_re_predicted(model, gpu, p99, conc) -> None:
    result = plan(model, gpu, p99_tokens=p99, concurrency=conc, allow_hub=False)
    assert result.fits and result.exit_code == 0
    rec = result.recommendation
    assert rec is not None and rec.candidate is result.plan
    assert result.plan.settings.max_model_len == p99
    assert result.plan.settings.max_num_seqs == conc
    # the margin holds when priced independently of the search's cache
    assert _independent_concurrency(result, p99) >= conc * 1.10 - 1e-9
    flags = {r.flag for r in rec.reasons}
    assert {"max-model-len", "max-num-seqs", "(verdict)"} <= flags
    assert all(r.reason for r in rec.reasons)


def test_cheapest_step_wins_over_lossy_ones() -> None:
    # 8B on an 80 GB card serves 16×8k with vLLM's defaults for everything but the caps:
    result = plan(LLAMA_8B, "H100", p99_tokens=8192, concurrency=16, allow_hub=False)
    s = result.plan.settings
    assert s.kv_cache_dtype == "auto" and s.quantization is None and s.tensor_parallel_size == 1
    assert s.max_num_batched_tokens is None
    assert result.recommendation is not None
    assert result.recommendation.steps[:3] == (
        "gpu_memory_utilization",
        "max_model_len",
        "max_num_seqs",
    )


def test_tight_gpu_escalates_through_the_checklist_in_order() -> None:
    result = plan(LLAMA_8B, "L4", p99_tokens=8192, concurrency=16, allow_hub=False)
    steps = result.recommendation.steps
    assert "quantization" in steps and "kv_cache_dtype" in steps  # fp8 KV is tried before weights
    # the cheaper configuration (every non-quantizing step at its most aggressive) does not serve
    import dataclasses

    cheaper = dataclasses.replace(
        result.plan.settings, quantization=None, max_num_batched_tokens=512
    )
    pred = predict(resolve_model(LLAMA_8B, allow_hub=False), find_gpu("L4"), cheaper)
    assert float(pred.max_concurrency) < 16 * 1.1


def test_tensor_parallel_over_given_gpus_uses_valid_sizes_only() -> None:
    model = resolve_model(LLAMA_70B, allow_hub=False)
    assert valid_tp_sizes(model, 8) == [1, 2, 4, 8]
    assert 3 not in valid_tp_sizes(model, 4)
    result = plan(LLAMA_70B, "H100", gpu_count=4, p99_tokens=8192, concurrency=32, allow_hub=False)
    assert result.fits
    assert result.plan.settings.tensor_parallel_size in (2, 4)
    assert result.plan.settings.quantization is None  # GPUs already there beat quantizing


def test_headroom_caps_utilization_and_is_respected() -> None:
    gpu = find_gpu("RTX 4090")
    result = plan(
        LLAMA_8B, "RTX 4090", p99_tokens=4096, concurrency=4, headroom_gib=3, allow_hub=False
    )
    util = result.plan.settings.gpu_memory_utilization
    assert util is not None and util < 0.92
    assert util * gpu.total_bytes <= gpu.total_bytes - 3 * 2**30
    reason = next(r for r in result.recommendation.reasons if r.flag == "gpu-memory-utilization")
    assert "co-tenants" in reason.reason


def test_shared_prefix_enables_prefix_caching_and_lowers_the_need() -> None:
    plain = plan(LLAMA_8B, "L4", p99_tokens=8192, concurrency=16, allow_hub=False)
    shared = plan(
        LLAMA_8B, "L4", p99_tokens=8192, concurrency=16, shared_prefix=0.5, allow_hub=False
    )
    assert shared.plan.settings.enable_prefix_caching is True
    assert shared.plan.serve.required_concurrency < plain.plan.serve.required_concurrency
    assert plain.plan.settings.enable_prefix_caching is None  # left at vLLM's default


def test_70b_on_a_4090_ranks_alternatives_offline() -> None:
    # (its speed is measured by bench/plan_speed.py, not asserted on a shared CPU)
    result = plan(LLAMA_70B, "RTX 4090", p99_tokens=8192, concurrency=16, allow_hub=False)
    assert not result.fits and result.exit_code == 1
    assert result.recommendation is None
    kinds = [a.kind for a in result.alternatives]
    assert {"more_gpus", "larger_gpu", "llama_cpp", "cpu_offload"} <= set(kinds)
    assert [a.rank for a in result.alternatives] == list(range(1, len(kinds) + 1))
    # hardware that serves the full workload comes before degraded or slow tiers
    first_partial = min(i for i, a in enumerate(result.alternatives) if not a.serves_workload)
    assert all(a.kind in ("more_gpus", "larger_gpu") for a in result.alternatives[:first_partial])
    # every vLLM alternative that claims to serve really does when re-predicted
    for alt in result.alternatives:
        if alt.candidate is not None and alt.serves_workload:
            c = alt.candidate
            pred = predict(c.model, c.gpu, c.settings)
            assert pred.fits and pred.max_concurrency >= 16 * 1.1
    more = next(a for a in result.alternatives if a.kind == "more_gpus")
    assert more.numbers["gpu_count"] in (2, 4, 8)
    lcpp = next(a for a in result.alternatives if a.kind == "llama_cpp")
    assert (
        0 < lcpp.numbers["n_gpu_layers"] < 81
        and f"--n-gpu-layers {lcpp.numbers['n_gpu_layers']}" in lcpp.command
    )
    offload = next(a for a in result.alternatives if a.kind == "cpu_offload")
    assert not offload.serves_workload  # 16×8k of KV alone exceeds the card


def test_cpu_offload_alternative_when_weights_are_the_problem() -> None:
    # one short request: the KV fits, but even int4 weights (37 GiB) do not fit 24 GB
    result = plan(LLAMA_70B, "RTX 4090", p99_tokens=4096, concurrency=1, allow_hub=False)
    assert not result.fits
    offload = [a for a in result.alternatives if a.kind == "cpu_offload" and a.serves_workload]
    assert offload, [a.title for a in result.alternatives]
    gb = offload[0].numbers["cpu_offload_gb"]
    assert f"--cpu-offload-gb {gb:g}" in offload[0].command
    assert any("PCIe" in c for c in offload[0].caveats)
    c = offload[0].candidate
    assert predict(c.model, c.gpu, c.settings).fits
    # one GiB less offload would not serve: the amount is the minimum
    import dataclasses

    less = predict(c.model, c.gpu, dataclasses.replace(c.settings, cpu_offload_gb=gb - 1))
    assert not less.fits or float(less.max_concurrency) < 1.1


def test_cpu_offload_does_not_serve_beyond_the_host_memory() -> None:
    """The offload tier holds its weights in pinned host RAM: with less host memory than it
    needs it is shown with the reason and does not claim to serve."""
    result = plan(
        LLAMA_70B, "RTX 4090", p99_tokens=4096, concurrency=1, allow_hub=False, host_memory_gib=16
    )
    offload = next(a for a in result.alternatives if a.kind == "cpu_offload")
    assert not offload.serves_workload
    assert "pinned host RAM" in offload.caveats[0] and "16.0 GiB usable" in offload.caveats[0]
    roomy = plan(
        LLAMA_70B, "RTX 4090", p99_tokens=4096, concurrency=1, allow_hub=False, host_memory_gib=512
    )
    assert next(a for a in roomy.alternatives if a.kind == "cpu_offload").serves_workload


def test_sizing_table_without_gpu() -> None:
    result = plan(LLAMA_8B, p99_tokens=8192, concurrency=32, allow_hub=False)
    assert result.gpu_source == "sizing" and result.sizing
    for row in result.sizing:
        assert row.serves and row.count in (1, 2, 4, 8)
        assert row.max_concurrency >= 32 * 1.1 - 1e-9
    costs = [row.count * row.total_gib for row in result.sizing]
    assert costs == sorted(costs)
    assert result.plan.gpu.name == result.sizing[0].gpu


JSON_KEYS = {
    "model", "vllm_version", "gpu", "settings", "memory", "kv_cache_tokens", "max_concurrency",
    "kv_bytes_per_token", "estimated_max_model_len", "fits", "problems", "command",
    "recommendation", "alternatives", "estimates", "calibration",
}  # fmt: skip
SETTINGS_KEYS = {
    "tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "quantization", "dtype",
    "enforce_eager", "kv_cache_memory_bytes",
}  # fmt: skip
MEMORY_KEYS = {
    "requested_gib",
    "weights_gib",
    "activation_gib",
    "non_torch_gib",
    "cudagraph_gib",
    "kv_cache_gib",
}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(model=LLAMA_8B, gpu="L4", p99_tokens=8192, concurrency=16),
        dict(model=LLAMA_70B, gpu="RTX 4090", p99_tokens=8192, concurrency=16),
        dict(model=LLAMA_8B, gpu="H100"),
    ],
)
def test_json_has_the_documented_keys(kwargs) -> None:
    data = json.loads(plan(**kwargs, allow_hub=False).to_json())
    assert JSON_KEYS <= set(data)
    assert {"name", "total_gib", "count"} <= set(data["gpu"])
    assert SETTINGS_KEYS <= set(data["settings"])
    assert MEMORY_KEYS <= set(data["memory"])
    assert all(
        v is not None for k, v in data["settings"].items() if k in ("max_model_len", "max_num_seqs")
    )
    assert data["command"].startswith("vllm serve ")
    assert isinstance(data["fits"], bool)
    assert {"activation", "non_torch", "cudagraph"} <= set(data["estimates"])
    assert data["estimates"]["activation"]["estimated"] is True
    assert data["calibration"]["used"] is False
    for problem in data["problems"]:
        assert set(problem) == {"code", "message"}


def test_given_config_that_does_not_fit_gets_a_fix_without_a_workload() -> None:
    result = plan(LLAMA_8B, "RTX 4090", allow_hub=False)  # default 131k context on 24 GB
    assert not result.fits and result.exit_code == 1
    assert result.plan is result.given
    fix = result.recommendation
    assert fix is not None and fix.candidate.fits


def test_public_import_and_command_input() -> None:
    from oomguard import plan as public_plan

    result = public_plan(
        command="vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 8k --port 8000",
        gpu="A100 80GB",
        allow_hub=False,
    )
    assert result.fits
    assert result.plan.settings.max_model_len == 8000
    assert "--port 8000" in result.command
