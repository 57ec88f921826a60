"""Interconnect-dependent non-torch memory, V0 batch defaults by release, PP stage weights."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomguard.facts.resolve import resolve_model
from oomguard.memory.activation import non_torch
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import AttentionKind, GPUSpec, ModelSpec
from oomguard.memory.versions import resolve_era, v0_chunked_prefill_tokens
from oomguard.memory.weights import weight_bytes_per_stage

from .builders import gemma_3_27b, llama_3_1_8b

GIB = 2**30
L4_NVLINK = GPUSpec("L4", int(22.17 * GIB), 24, compute_capability="8.9", device_name="NVIDIA L4")
L4 = replace(L4_NVLINK, nvlink=False)


@pytest.mark.parametrize(
    ("version", "engine", "pcie_gib", "nvlink_gib", "nvls_gib"),
    [
        ("0.28", "v1", 0.25, 0.55, 2.08),
        ("0.19", "v1", 0.25, 0.55, 2.08),
        ("0.11", "v1", 0.25, 0.55, 0.55),
        ("0.7", "v0", 0.25, 2.0, 2.0),
        ("0.10", "v1", 0.25, 2.0, 2.0),
    ],
)
def test_non_torch_tp_depends_on_the_link(
    version: str, engine: str, pcie_gib: float, nvlink_gib: float, nvls_gib: float
) -> None:
    """PCIe: ring buffers only; NVLink: NCCL's communicator (all of it where the snapshot
    predates NCCL's set-up, ≤ 0.10); NVSwitch Hopper: NVLS too, from 0.11 (cuMem on)."""
    era = resolve_era(version, engine)
    pcie = non_torch(era, tp=2, pp=1, nvlink=False)
    linked = non_torch(era, tp=2, pp=1, nvlink=True)
    nvls = non_torch(era, tp=2, pp=1, nvlink=True, nvls=True)
    assert pcie.value_bytes / GIB == pytest.approx(pcie_gib, abs=0.005)
    assert linked.value_bytes / GIB == pytest.approx(nvlink_gib, abs=0.005)
    assert nvls.value_bytes / GIB == pytest.approx(nvls_gib, abs=0.005)
    for est in (pcie, linked, nvls):
        assert est.low_bytes <= est.value_bytes <= est.high_bytes
    # one GPU or pipeline stages only: the link plays no part
    assert non_torch(era, tp=1, pp=1, nvlink=False) == non_torch(era, tp=1, pp=1, nvls=True)
    assert non_torch(era, tp=1, pp=2, nvlink=False) == non_torch(era, tp=1, pp=2, nvls=True)


def test_nvswitch_hopper_tp_leaves_less_kv_cache_than_pcie() -> None:
    settings = EngineSettings(vllm_version="0.28", tensor_parallel_size=2, max_model_len=8192)
    pcie = predict(llama_3_1_8b(), L4, settings)
    switched = predict(llama_3_1_8b(), replace(L4_NVLINK, nvls=True), settings)
    lost = pcie.kv_cache_bytes - switched.kv_cache_bytes
    assert lost == switched.non_torch.value_bytes - pcie.non_torch.value_bytes
    assert lost / GIB == pytest.approx(2.08 - 0.25, abs=0.01)
    assert "PCIe" in pcie.non_torch.basis and "NVLS" in switched.non_torch.basis


def test_catalogue_marks_nvswitch_hopper_parts() -> None:
    from oomguard.facts.gpus import find_gpu

    assert find_gpu("H100 SXM").nvls and find_gpu("H200").nvls and find_gpu("B200").nvls
    assert not find_gpu("A100 80GB SXM").nvls  # NVSwitch, but NVLS is Hopper's
    assert not find_gpu("H100 NVL").nvls and not find_gpu("L40S").nvls


def test_v0_chunked_prefill_default_by_release() -> None:
    assert v0_chunked_prefill_tokens(6, 4) == 512  # 0.6.4.post1
    assert v0_chunked_prefill_tokens(5, 4) == 512
    assert v0_chunked_prefill_tokens(6, 5) == 2048  # vllm PR #10544
    assert v0_chunked_prefill_tokens(7, 2) == 2048
    assert resolve_era("0.6.4.post1", "v0").v0_chunked_prefill_tokens == 512
    assert resolve_era("0.7.1", "v0").v0_chunked_prefill_tokens == 2048


@pytest.mark.parametrize(
    ("version", "usage", "tokens"),
    [
        ("0.6.4.post1", "server", 512),
        ("0.6.4", "llm", 512),
        ("0.7.1", "server", 2048),
        ("0.7.1", "llm", 2048),
        ("0.8.5", "llm", 2048),
    ],
)
def test_v0_long_context_turns_chunked_prefill_on(version: str, usage: str, tokens: int) -> None:
    gpu = GPUSpec("A10", int(22.2 * GIB), 24, compute_capability="8.6", device_name="NVIDIA A10")
    settings = EngineSettings(vllm_version=version, engine="v0", usage_context=usage)
    pred = predict(llama_3_1_8b(), gpu, settings)  # derived max_model_len 131072 > 32K
    assert pred.settings.max_model_len == 131072
    assert pred.settings.max_num_batched_tokens == tokens


def test_v0_without_chunked_prefill_batches_the_whole_context() -> None:
    gpu = GPUSpec("H100", int(79.19 * GIB), 80, compute_capability="9.0")
    short = predict(
        llama_3_1_8b(), gpu, EngineSettings(vllm_version="0.7.1", engine="v0", max_model_len=32768)
    )
    assert short.settings.max_num_batched_tokens == 32768  # not > 32K: no chunked prefill
    tiny = predict(
        llama_3_1_8b(), gpu, EngineSettings(vllm_version="0.7.1", engine="v0", max_model_len=1024)
    )
    assert tiny.settings.max_num_batched_tokens == 2048
    # sliding-window layers keep chunked prefill off even for long contexts
    gemma = gemma_3_27b()
    assert any(layer.kind is AttentionKind.SLIDING for layer in gemma.layers)
    assert gemma.derived_max_model_len > 32768
    long = predict(
        gemma,
        gpu,
        EngineSettings(vllm_version="0.7.1", engine="v0", max_model_len=65536),
        strict=False,
    )
    assert long.settings.max_num_batched_tokens == 65536


def _deepseek_v2_5() -> ModelSpec:
    # the catalogue's config.json: 60 layers, first_k_dense_replace 1, 160 routed experts
    return resolve_model("deepseek-ai/DeepSeek-V2.5", allow_hub=False)


def test_first_k_dense_moe_loads_later_pp_stages_more() -> None:
    model = _deepseek_v2_5()
    assert model.moe is not None and model.moe.num_moe_layers == model.num_layers - 1
    even = replace(model, model_type="even_spread_for_comparison")
    staged = weight_bytes_per_stage(model, model_dtype="bfloat16", tp=8, pp=2).per_stage_bytes
    spread = weight_bytes_per_stage(even, model_dtype="bfloat16", tp=8, pp=2).per_stage_bytes
    # the dense first layer sits on stage 0, so it holds one MoE layer's share less
    assert staged[0] < spread[0] and staged[1] > spread[1]
    assert sum(staged) == pytest.approx(sum(spread), rel=1e-9)  # only placement moves
    # a real TP8 x PP2 start logged 27.63 GiB on a first-stage rank and 28.48 GiB on another:
    # 0.85 GiB apart, one MoE layer less one dense layer per rank
    assert (staged[1] - staged[0]) / GIB == pytest.approx(0.85, abs=0.05)
    assert (spread[1] - spread[0]) / GIB == pytest.approx(0.0, abs=0.01)


def test_worst_stage_drives_the_block_count() -> None:
    model = _deepseek_v2_5()
    gpu = GPUSpec("A100 40GB", int(39.49 * GIB), 40, compute_capability="8.0")
    settings = EngineSettings(
        vllm_version="0.8.3",
        engine="v0",
        tensor_parallel_size=8,
        pipeline_parallel_size=2,
        max_model_len=8192,
        enforce_eager=True,
    )
    pred = predict(model, gpu, settings)
    first, last = pred.stages
    assert last.weights_bytes > first.weights_bytes  # more MoE layers
    assert last.activation_bytes > first.activation_bytes  # the sampler runs on the last stage
    assert pred.num_blocks == last.num_blocks < first.num_blocks
    assert pred.kv_cache_bytes == last.kv_cache_bytes
