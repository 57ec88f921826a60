"""Versions, defaults, weights, CPU mode and the predict() contract."""

from __future__ import annotations

from typing import Any

import pytest

from oomguard.errors import BadInput
from oomguard.memory.engine import EngineSettings, MeasuredTerms, predict
from oomguard.memory.logtext import format_gib
from oomguard.memory.spec import GPUSpec, QuantSpec
from oomguard.memory.versions import batch_defaults, resolve_era
from oomguard.memory.weights import (
    pp_layer_ranges,
    quantized_bytes_per_element,
    weight_bytes_per_stage,
)

from .builders import gpt_oss_120b, llama_3_1_8b, llama_3_70b

GIB = 2**30
H100 = GPUSpec(
    "H100 SXM", int(79.19 * GIB), 80, compute_capability="9.0", device_name="NVIDIA H100 80GB HBM3"
)
A100 = GPUSpec(
    "A100 80GB", int(79.15 * GIB), 80, compute_capability="8.0", device_name="NVIDIA A100-SXM4-80GB"
)
B200 = GPUSpec("B200", int(178.4 * GIB), 192, compute_capability="10.0", device_name="NVIDIA B200")
NODE = GPUSpec("cpu-node", 64 * GIB, 64, vendor="cpu")


def test_version_strings() -> None:
    assert resolve_era("0.11.2").minor == 11
    assert resolve_era("v0.19.0").minor == 19
    assert resolve_era("0.20.1rc1.dev16+g7a1eb8ac2").minor == 20
    assert resolve_era("latest").minor == 33
    for bad in ("banana", "0.9.2", "1.0", "0.34", ""):
        if bad == "":
            assert resolve_era(bad).minor == 33
            continue
        with pytest.raises(BadInput):
            resolve_era(bad)
    assert resolve_era("0.8.2", engine="v0").engine == "v0"
    with pytest.raises(BadInput, match="V0"):
        resolve_era("0.19", engine="v0")


def test_version_defaults() -> None:
    assert resolve_era("0.19").default_gpu_memory_utilization == 0.9
    assert resolve_era("0.20").default_gpu_memory_utilization == 0.92
    e = resolve_era("0.27")
    kw: dict[str, Any] = dict(
        platform="cuda", device_total_bytes=int(178 * GIB), device_name="nvidia b200"
    )
    assert batch_defaults(e, usage_context="server", **kw).max_num_batched_tokens == 8192
    assert (
        batch_defaults(resolve_era("0.28"), usage_context="server", **kw).max_num_batched_tokens
        == 16384
    )
    a100: dict[str, Any] = dict(
        platform="cuda", device_total_bytes=int(79.15 * GIB), device_name="nvidia a100-sxm4-80gb"
    )
    assert batch_defaults(e, usage_context="server", **a100).max_num_seqs == 256
    assert batch_defaults(e, usage_context="llm", **a100).max_num_batched_tokens == 8192
    cpu = batch_defaults(
        e,
        platform="cpu",
        usage_context="server",
        device_total_bytes=0,
        device_name="",
        world_size=2,
    )
    assert (cpu.max_num_batched_tokens, cpu.max_num_seqs) == (4096, 256)


def test_resolved_settings_fill_every_default() -> None:
    p = predict(llama_3_1_8b(), H100, EngineSettings())
    s = p.settings
    assert s.vllm_version == "0.33" and s.gpu_memory_utilization == 0.92
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.block_size) == (8192, 1024, 16)
    assert s.max_model_len == 131072
    assert (
        p.requested_bytes == -(-H100.total_bytes * 92 // 100)
        or abs(p.requested_bytes - H100.total_bytes * 0.92) < 2
    )
    assert p.cudagraph.value_bytes > 0 and p.cudagraph.estimated  # subtracted by default from 0.20
    eager = predict(llama_3_1_8b(), H100, EngineSettings(enforce_eager=True))
    assert eager.cudagraph.value_bytes == 0
    assert eager.kv_cache_bytes - p.kv_cache_bytes == p.cudagraph.value_bytes
    old = predict(llama_3_1_8b(), H100, EngineSettings(vllm_version="0.19"))
    assert old.cudagraph.value_bytes == 0
    b200 = predict(llama_3_1_8b(), B200, EngineSettings(vllm_version="0.28"))
    assert (b200.settings.max_num_batched_tokens, b200.settings.max_num_seqs) == (16384, 1024)
    clamped = predict(
        llama_3_1_8b(), H100, EngineSettings(vllm_version="0.19", max_num_batched_tokens=512)
    )
    assert clamped.settings.max_num_seqs == 512


def test_measured_terms_replace_estimates() -> None:
    m = MeasuredTerms(
        weights_bytes=15 * GIB, activation_bytes=2 * GIB, non_torch_bytes=GIB // 4, source="log"
    )
    p = predict(
        llama_3_1_8b(),
        H100,
        EngineSettings(vllm_version="0.19", gpu_memory_utilization=0.95),
        measured=m,
    )
    assert set(p.measured_terms) == {"weights", "activation", "non_torch"}
    assert not p.weights.estimated and p.weights.basis == "measured (log)"
    assert abs(p.kv_cache_bytes - (p.total_bytes * 0.95 - 15 * GIB - 2 * GIB - GIB // 4)) <= 1


def test_weights_of_llama_8b_match_the_logged_load() -> None:
    # "Model loading took 14.9889 GiB" (PR #17122); parameters alone are 14.96 GiB + rotary cache
    w = weight_bytes_per_stage(llama_3_1_8b(), model_dtype="bfloat16")
    assert abs(w.max_bytes / GIB - 14.9889) < 0.005
    w2 = weight_bytes_per_stage(llama_3_1_8b(), model_dtype="bfloat16", tp=2)
    assert abs(w2.max_bytes / GIB - 7.51) < 0.02  # 0.19 log at TP=2: 7.51 GiB
    pp = weight_bytes_per_stage(llama_3_1_8b(), model_dtype="bfloat16", pp=4)
    assert (
        len(pp.per_stage_bytes) == 4 and abs(pp.per_stage_bytes[0] / GIB - 4.26) < 0.05
    )  # 0.19 PP=4 log


def test_pp_split_follows_vllm() -> None:
    assert [len(r) for r in pp_layer_ranges(10, 4)] == [2, 3, 3, 2]
    with pytest.raises(BadInput):
        pp_layer_ranges(4, 8)


def test_quantized_bytes_per_element() -> None:
    assert quantized_bytes_per_element(QuantSpec("awq", 4, 128, True), 4096) == pytest.approx(
        0.5 + 2.5 / 128
    )
    assert quantized_bytes_per_element(QuantSpec("fp8", 8), 4096) == 1.0
    assert quantized_bytes_per_element(QuantSpec("mxfp4", 4), 2880) == 0.53125
    assert quantized_bytes_per_element(QuantSpec("nvfp4", 4), 4096) == 0.5625
    assert (
        quantized_bytes_per_element(QuantSpec("gguf", 4, gguf_bits_per_weight=4.5), 4096) == 4.5 / 8
    )
    fp8 = weight_bytes_per_stage(llama_3_1_8b(), model_dtype="bfloat16", quantization="fp8")
    assert abs(fp8.max_bytes / GIB - 8.49) < 0.05  # 0.19 log, online fp8: 8.49 GiB


def test_impossible_tp_is_bad_input_or_problem() -> None:
    with pytest.raises(BadInput, match="divisible"):
        predict(llama_3_1_8b(), H100, EngineSettings(tensor_parallel_size=3))
    p = predict(llama_3_1_8b(), H100, EngineSettings(tensor_parallel_size=3), strict=False)
    assert [x.code for x in p.problems][0] == "tp_not_divisible" and not p.fits


def test_bad_values_raise_one_line_errors() -> None:
    for s in (
        EngineSettings(gpu_memory_utilization=1.5),
        EngineSettings(max_model_len=-5),
        EngineSettings(vllm_version="0.5"),
        EngineSettings(platform="tpu"),
        EngineSettings(kv_cache_dtype="int3"),
    ):
        with pytest.raises(BadInput) as info:
            predict(llama_3_1_8b(), H100, s)
        assert "\n" not in info.value.one_line()


def test_free_memory_check_and_longer_than_derived() -> None:
    p = predict(llama_3_1_8b(), H100, EngineSettings(vllm_version="0.19"), free_bytes=60 * GIB)
    (problem,) = [x for x in p.problems if x.code == "free_memory_below_requested"]
    assert problem.message.startswith(
        "Free memory on device cuda:0 (60.0/79.19 GiB) on startup is less than"
    )
    p2 = predict(llama_3_70b(), H100, EngineSettings(tensor_parallel_size=4, max_model_len=100000))
    assert "max_len_exceeds_derived" in {x.code for x in p2.problems}


def test_cpu_backend_kv_pool_is_used_directly() -> None:
    model = llama_3_1_8b(dtype="bfloat16")
    s = EngineSettings(
        vllm_version="0.32", platform="cpu", max_model_len=4096, kv_cache_memory_bytes=2 * GIB
    )
    p = predict(model, NODE, s)
    assert p.settings.block_size == 128
    assert (p.settings.max_num_batched_tokens, p.settings.max_num_seqs) == (2048, 128)
    assert p.bytes_per_block == 32 * 128 * 2 * 8 * 128 * 2
    assert p.num_blocks == 2 * GIB // p.bytes_per_block == 128
    assert p.kv_cache_tokens == int(128 / 32 * 4096)
    assert p.log_lines[-1] == (
        "CPU KV cache size: 16,384 tokens, Maximum concurrency for 4,096 tokens per request: 4.00x"
    )
    env = predict(
        model,
        NODE,
        EngineSettings(
            vllm_version="0.32", platform="cpu", max_model_len=4096, cpu_kvcache_space_gib=2
        ),
    )
    assert env.num_blocks == 128
    small = predict(
        model,
        NODE,
        EngineSettings(
            vllm_version="0.32",
            platform="cpu",
            max_model_len=4096,
            kv_cache_memory_bytes=20 * 2**24,
        ),
    )
    assert not small.fits and small.estimated_max_model_len == (20 - 1) * 128
    assert "estimated maximum model length is 2432" in small.log_lines[-1]


def test_gpt_oss_mxfp4_weights_pad_experts() -> None:
    model = gpt_oss_120b()
    from dataclasses import replace

    model = replace(
        model, quant=QuantSpec("mxfp4", 4, 32, unquantized_groups=("attn_qo", "attn_kv"))
    )
    w19 = weight_bytes_per_stage(
        model, model_dtype="bfloat16", pad_intermediate=resolve_era("0.19").mxfp4_pad_intermediate
    )
    w11 = weight_bytes_per_stage(
        model, model_dtype="bfloat16", pad_intermediate=resolve_era("0.11").mxfp4_pad_intermediate
    )
    assert w19.max_bytes > w11.max_bytes  # intermediate padded to 128 from 0.13


def test_predict_renders_json() -> None:
    # (its speed is measured by bench/plan_speed.py, not asserted under a shared CPU)
    model, s = gpt_oss_120b(), EngineSettings(max_model_len=131072)
    p = predict(model, H100, s)
    d = p.to_dict()
    assert set(d["memory"]) >= {
        "requested_gib",
        "weights_gib",
        "activation_gib",
        "non_torch_gib",
        "cudagraph_gib",
        "kv_cache_gib",
    }
    assert format_gib(7.5 * GIB) == "7.5" and format_gib(0) == "0.0"


def test_measured_terms_list_only_the_terms_used() -> None:
    m = MeasuredTerms(
        weights_bytes=15 * GIB,
        activation_bytes=2 * GIB,
        non_torch_bytes=GIB // 4,
        cudagraph_bytes=GIB,
        source="log",
    )
    # 0.19 does not subtract a CUDA-graph estimate: the measured graphs are not used
    old = predict(llama_3_1_8b(), H100, EngineSettings(vllm_version="0.19"), measured=m)
    assert "cudagraph" not in old.measured_terms and old.cudagraph.value_bytes == 0
    assert set(old.measured_terms) == {"weights", "activation", "non_torch"}
    # 0.20+ subtracts it: the measured GiB replaces the estimate and the KV budget shrinks by it
    new = predict(llama_3_1_8b(), H100, EngineSettings(vllm_version="0.20"), measured=m)
    assert "cudagraph" in new.measured_terms and new.cudagraph.value_bytes == GIB
    expected = new.requested_bytes - 15 * GIB - 2 * GIB - GIB // 4 - GIB
    assert abs(new.kv_cache_bytes - expected) <= 1
    # eager mode captures nothing
    eager = predict(
        llama_3_1_8b(), H100, EngineSettings(vllm_version="0.20", enforce_eager=True), measured=m
    )
    assert "cudagraph" not in eager.measured_terms and eager.cudagraph.value_bytes == 0
    # with pipeline parallelism each stage uses the term, and it is listed once
    pp = predict(
        llama_3_1_8b(),
        H100,
        EngineSettings(vllm_version="0.20", pipeline_parallel_size=2),
        measured=m,
    )
    assert pp.measured_terms.count("weights") == 1
    # the CPU backend has no graph term to replace; its non-torch term is the worker's runtime
    # outside weights and activations, measured (serve) in place of the baseline estimate
    settings = EngineSettings(vllm_version="0.20", platform="cpu", max_model_len=4096)
    cpu = predict(llama_3_1_8b(), NODE, settings, measured=m)
    assert "non_torch" in cpu.measured_terms and "cudagraph" not in cpu.measured_terms
    assert cpu.non_torch.value_bytes == GIB // 4
    assert cpu.kv_cache_bytes == cpu.requested_bytes - 15 * GIB - 2 * GIB - GIB // 4
    assert cpu.to_dict()["measured_terms"] == list(cpu.measured_terms)
    unmeasured = predict(llama_3_1_8b(), NODE, settings)
    assert unmeasured.non_torch.value_bytes == 0 and "non_torch" not in unmeasured.measured_terms
