"""Byte-exact page sizes, groups, block counts and token formulas (vllm-memory §4–§7)."""

from __future__ import annotations

from typing import Any

import pytest

from oomguard.errors import BadInput
from oomguard.memory import kv as kvm
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import GPUSpec
from oomguard.memory.versions import resolve_era

from .builders import (
    deepseek_v3,
    gemma_3_27b,
    gpt_oss_120b,
    llama_3_1_8b,
    llama_3_70b,
    qwen3_next_80b,
)

GIB = 2**30
MIB = 2**20
L40S = GPUSpec("L40S", int(44.39 * GIB), 48, compute_capability="8.9", device_name="NVIDIA L40S")
H100 = GPUSpec(
    "H100 SXM", int(79.19 * GIB), 80, compute_capability="9.0", device_name="NVIDIA H100 80GB HBM3"
)


def _layout(model, era="0.19", tp=1, kv_dtype="auto", block=16):
    e = resolve_era(era)
    built = kvm.build_layer_specs(
        model, tp=tp, model_dtype="bfloat16", kv_cache_dtype=kv_dtype, block_size=block, era=e
    )
    specs = [(i, s) for i, s in enumerate(built.specs) if s is not None]
    return built, kvm.group_layers(specs, e), e


def test_llama_3_1_8b_worked_example_on_l40s() -> None:
    # PR #17122 log: B = 9,916 blocks of 2 MiB → 158,656 tokens, 4.84x at 32,768.
    model = llama_3_1_8b()
    built, layout, era = _layout(model)
    assert built.specs[0].page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65536
    assert layout.bytes_per_block == 2 * MIB
    s = EngineSettings(
        vllm_version="0.19", max_model_len=32768, kv_cache_memory_bytes=9916 * 2 * MIB + 123
    )
    p = predict(model, L40S, s)
    assert p.num_blocks == 9916
    assert p.kv_bytes_per_token == 128 * 1024
    assert p.kv_cache_tokens == 158_656
    assert p.log_lines[-2:] == (
        "GPU KV cache size: 158,656 tokens",
        "Maximum concurrency for 32,768 tokens per request: 4.84x",
    )
    newest = predict(
        model, L40S, EngineSettings(max_model_len=32768, kv_cache_memory_bytes=9916 * 2 * MIB)
    )
    assert newest.kv_cache_tokens == 158_656  # int(9916 / 2048 * 32768) has no rounding loss
    assert newest.log_lines[-1] == (
        "GPU KV cache size: 158,656 tokens, Maximum concurrency for 32,768 "
        "tokens per request: 4.84x"
    )


def test_int_truncation_of_concurrency_times_length_at_32000() -> None:
    model = llama_3_1_8b()
    _, layout, _ = _layout(model, era="0.21")
    era21, era20 = resolve_era("0.21"), resolve_era("0.20")
    bound = kvm.RequestBound(max_model_len=32000, lookahead_tokens=2048)
    lossy = [b for b in range(5000, 9000) if int(b / 2000 * 32000) == b * 16 - 1]
    assert lossy, "some block counts must lose one token to float truncation at L=32,000"
    b = lossy[0]
    assert kvm.kv_cache_tokens(b, layout, bound, era21) == b * 16 - 1
    assert kvm.kv_cache_tokens(b, layout, bound, era20) == b * 16  # (B // groups) × block size
    pow2 = kvm.RequestBound(max_model_len=32768, lookahead_tokens=2048)
    assert all(kvm.kv_cache_tokens(x, layout, pow2, era21) == x * 16 for x in range(5000, 6000))


def test_tp_replicates_kv_heads_beyond_their_count() -> None:
    model = llama_3_70b()  # 8 KV heads
    for tp in (8, 16):
        built, layout, _ = _layout(model, tp=tp)
        assert built.specs[0].num_kv_heads == 1
        assert built.specs[0].page_size_bytes == 2 * 16 * 1 * 128 * 2
        assert layout.bytes_per_block == 80 * 8192
    built4, _, _ = _layout(model, tp=4)
    assert built4.specs[0].num_kv_heads == 2
    with pytest.raises(BadInput, match="KV heads"):
        kvm.kv_heads_per_rank(8, 3)
    with pytest.raises(BadInput, match="multiple"):
        kvm.kv_heads_per_rank(8, 12)


def test_fp8_and_newer_kv_dtypes_page_sizes() -> None:
    model = llama_3_1_8b()
    for dtype, head_bytes in (
        ("fp8", 128),
        ("fp8_e5m2", 128),
        ("nvfp4", 72),
        ("int8_per_token_head", 132),
        ("int4_per_token_head", 68),
    ):
        built, _, _ = _layout(model, era="0.32", kv_dtype=dtype)
        assert built.specs[0].page_size_bytes == 16 * 8 * 2 * head_bytes, dtype
    with pytest.raises(BadInput, match="0.20"):
        kvm.check_kv_cache_dtype("nvfp4", resolve_era("0.19"))
    with pytest.raises(BadInput, match="unknown"):
        kvm.check_kv_cache_dtype("fp4", resolve_era("0.32"))


def test_mla_page_is_one_latent_and_not_sharded_by_tp() -> None:
    model = deepseek_v3()
    for tp in (1, 8):
        built, layout, _ = _layout(model, tp=tp, block=64)
        assert built.specs[0].page_size_bytes == 64 * 576 * 2
        assert layout.bytes_per_block == 61 * 64 * 1152 == 4_497_408
    built, _, _ = _layout(model, kv_dtype="fp8", block=64)
    assert built.specs[0].page_size_bytes == 64 * 576


def test_gpt_oss_sliding_window_groups_and_per_request_blocks() -> None:
    model = gpt_oss_120b()
    built, layout, era = _layout(model)
    assert built.specs[0].page_size_bytes == 32 * 1024
    assert layout.num_groups == 2 and [g.num_layers for g in layout.groups] == [18, 18]
    assert layout.bytes_per_block == 576 * 1024
    assert layout.blocks_per_request(kvm.RequestBound(131072, 8192)) == 8192 + 521 == 8713
    assert layout.blocks_per_request(kvm.RequestBound(131072, 16384)) == 8192 + 1033 == 9225
    b = 100_000
    assert (
        kvm.kv_cache_tokens(b, layout, kvm.RequestBound(131072, 8192), resolve_era("0.20"))
        == (b // 2) * 16
    )
    assert kvm.kv_cache_tokens(
        b, layout, kvm.RequestBound(131072, 8192), resolve_era("0.21")
    ) == int(b / 8713 * 131072)


def test_gpt_oss_async_scheduling_doubles_the_window_bound_from_0_26() -> None:
    model = gpt_oss_120b()
    s: dict[str, Any] = dict(
        max_model_len=131072, kv_cache_memory_bytes=10 * GIB, max_num_batched_tokens=8192
    )
    p25 = predict(model, H100, EngineSettings(vllm_version="0.25", **s))
    p26 = predict(model, H100, EngineSettings(vllm_version="0.26", **s))
    assert p25.num_blocks == p26.num_blocks == 10 * GIB // (576 * 1024)
    assert p25.max_concurrency == pytest.approx(p25.num_blocks / 8713)
    assert p26.max_concurrency == pytest.approx(p26.num_blocks / 9225)


def test_gemma_3_grouping_pads_eight_layers() -> None:
    model = gemma_3_27b()
    _, layout, _ = _layout(model)
    assert layout.num_groups == 7  # 1 full group + 6 sliding groups of 10 slots
    assert layout.bytes_per_block == 10 * 128 * 1024
    assert layout.padding_warnings == (
        "Add 8 padding layers, may waste at most 15.38% KV cache memory",
    )
    n = layout.blocks_per_request(kvm.RequestBound(8192, 8192))
    assert n == 512 + 6 * (512 + 1)


def test_gemma_3_27b_matches_logged_h100_capacity() -> None:
    # vLLM 0.19 log: available 19.53 GiB → 36,560 tokens, 4.46x at 8,192.
    model = gemma_3_27b()
    p = predict(
        model,
        H100,
        EngineSettings(
            vllm_version="0.19",
            max_model_len=8192,
            max_num_batched_tokens=8192,
            kv_cache_memory_bytes=int(19.53 * GIB),
        ),
    )
    assert p.kv_cache_tokens == 36_560
    assert f"{p.max_concurrency:.2f}" == "4.46"


def test_qwen3_next_mamba_block_raise_and_padding() -> None:
    model = qwen3_next_80b()
    built, layout, _ = _layout(model, era="0.19")
    assert built.block_size == 544
    assert built.mamba_padding_pct is not None and f"{built.mamba_padding_pct:.2f}" == "1.49"
    mamba = next(s for s in built.specs if isinstance(s, kvm.Mamba))
    assert mamba.raw_page_size_bytes == 1_097_728
    assert mamba.page_size_bytes == 1_114_112 == 544 * 2048
    built4, _, _ = _layout(model, era="0.19", tp=4)
    assert built4.block_size == 272
    mamba4 = next(s for s in built4.specs if isinstance(s, kvm.Mamba))
    assert mamba4.raw_page_size_bytes == 274_432
    assert f"{built4.mamba_padding_pct:.2f}" == "1.49"
    # 12 attention + 36 Mamba layers: group size 12 → 1 attention + 3 Mamba groups
    assert layout.num_groups == 4 and layout.bytes_per_block == 12 * 1_114_112


def test_fit_check_subtracts_the_null_block_from_0_29() -> None:
    model = llama_3_1_8b()
    blocks = 8192 // 16  # exactly one request at L = 8192
    s: dict[str, Any] = dict(max_model_len=8192, kv_cache_memory_bytes=blocks * 2 * MIB)
    ok = predict(model, H100, EngineSettings(vllm_version="0.28", **s))
    assert ok.fits and ok.estimated_max_model_len is None
    bad = predict(model, H100, EngineSettings(vllm_version="0.29", **s))
    assert not bad.fits
    assert bad.estimated_max_model_len == (blocks - 1) * 16
    (problem,) = [p for p in bad.problems if p.code == "max_len_exceeds_kv"]
    assert problem.message == (
        "To serve at least one request with the model's max seq len (8192), (1.0 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (1.0 GiB). Based on the "
        "available memory, the estimated maximum model length is 8176. Try increasing "
        "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
        "decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more "
        "details."
    )
    assert problem.message in bad.log_lines


def test_fit_error_text_of_older_releases() -> None:
    model = llama_3_1_8b()
    s: dict[str, Any] = dict(max_model_len=32768, kv_cache_memory_bytes=1000 * 2 * MIB)
    p = predict(model, H100, EngineSettings(vllm_version="0.11", **s))
    (problem,) = [x for x in p.problems if x.code == "max_len_exceeds_kv"]
    assert problem.message.startswith(
        "To serve at least one request with the models's max seq len (32768), (4.00 GiB KV cache "
        "is needed, which is larger than the available KV cache memory (1.95 GiB). Based on the "
        "available memory, the estimated maximum model length is 16000. Try"
    )
    assert p.estimated_max_model_len == 16000


def test_auto_fit_reduces_max_model_len() -> None:
    model = llama_3_1_8b()
    p = predict(model, H100, EngineSettings(max_model_len=-1, kv_cache_memory_bytes=1001 * 2 * MIB))
    assert p.fits
    assert p.settings.max_model_len == 1000 * 16  # one block held back as the null block
    assert any(
        line.startswith("Auto-fit max_model_len: reduced from 131072 to 16000")
        for line in p.log_lines
    )
    with pytest.raises(BadInput, match="0.14"):
        predict(model, H100, EngineSettings(vllm_version="0.13", max_model_len=-1))


def test_no_kv_memory_when_weights_fill_the_budget() -> None:
    # 131 GiB of bf16 weights on an 80 GB card: loading itself fails, nothing after it runs
    model = llama_3_70b()
    p = predict(model, H100, EngineSettings(vllm_version="0.19"))
    codes = {x.code for x in p.problems}
    assert "weights_exceed_gpu" in codes and "no_kv_memory" not in codes
    assert not p.fits
    assert not any("KV cache" in line for line in p.log_lines)


def test_weights_above_budget_but_inside_device_leave_no_kv() -> None:
    # weights load (util does not limit loading), then the budget has nothing left for KV
    model = llama_3_70b()
    tight = EngineSettings(vllm_version="0.19", tensor_parallel_size=2, gpu_memory_utilization=0.8)
    p = predict(model, H100, tight)
    codes = {x.code for x in p.problems}
    assert "weights_exceed_budget" in codes and "no_kv_memory" in codes
    assert "weights_exceed_gpu" not in codes
    assert not p.fits
