"""Context parallelism, KV offloading and connectors, sleep mode, CUDA-graph settings and the
hybrid Mamba flags (docs/memory-model.md §14), byte-exact where vLLM's arithmetic is exact.

Expected figures follow vllm 0.32's source as §14 cites it: per-request blocks of a DCP-sharded
full-attention or MLA layer are ``cdiv(cdiv(L, dcp), block_size)``, the token line is
``int(B / Σ n_g × L)``, Mamba state dtypes follow ``MambaStateDtypeCalculator``.
"""

from __future__ import annotations

import pytest

from oomguard.errors import BadInput
from oomguard.memory import kv as kvm
from oomguard.memory.compilation import (
    GraphSettings,
    capture_sizes,
    graph_settings,
    read_compilation_config,
)
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.offload import kv_connector
from oomguard.memory.sleep import sleep_footprints
from oomguard.memory.spec import GPUSpec
from oomguard.memory.versions import resolve_era

from .builders import deepseek_v3, gpt_oss_120b, llama_3_1_8b, qwen3_next_80b

GIB = 2**30
H100 = GPUSpec(
    "H100 SXM", int(79.19 * GIB), 80, compute_capability="9.0", device_name="NVIDIA H100 80GB HBM3"
)
H200 = GPUSpec("H200", int(139.8 * GIB), 141, compute_capability="9.0", device_name="NVIDIA H200")


# -- §14.1 context parallelism ----------------------------------------------------------------


def test_dcp_shards_full_attention_tokens_in_0_32() -> None:
    base = EngineSettings(vllm_version="0.32", tensor_parallel_size=2, max_model_len=32768)
    plain = predict(llama_3_1_8b(), H100, base)
    sharded = predict(
        llama_3_1_8b(), H100, EngineSettings(**{**base.__dict__, "decode_context_parallel_size": 2})
    )
    # the pool per rank is the same: DCP reuses the TP ranks and keeps the KV heads per rank
    assert sharded.num_blocks == plain.num_blocks
    assert sharded.bytes_per_block == plain.bytes_per_block
    blocks = sharded.num_blocks
    # one request holds cdiv(cdiv(32768, 2), 16) = 1024 blocks instead of 2048
    assert plain.max_concurrency == blocks / 2048
    assert sharded.max_concurrency == blocks / 1024
    assert sharded.kv_cache_tokens == int(blocks / 1024 * 32768)
    assert f"{sharded.kv_cache_tokens:,} tokens" in sharded.log_lines[-1]


def test_dcp_on_mla_divides_the_latent_blocks_per_request() -> None:
    s = EngineSettings(
        vllm_version="0.32",
        tensor_parallel_size=8,
        decode_context_parallel_size=8,
        max_model_len=131072,
        kv_cache_memory_bytes=40 * GIB,
    )
    p = predict(deepseek_v3(), H200, s)
    # 61 MLA layers × 576 × 2 B per token; the pool is fixed by kv_cache_memory_bytes
    assert p.bytes_per_block == 61 * p.block_size * 576 * 2
    assert p.num_blocks == 40 * GIB // p.bytes_per_block
    per_request = kvm.cdiv(kvm.cdiv(131072, 8), p.block_size)
    assert p.max_concurrency == p.num_blocks / per_request


def test_pcp_adds_ranks_but_not_kv_in_0_32() -> None:
    base = dict(vllm_version="0.32", tensor_parallel_size=2, max_model_len=32768)
    plain = predict(llama_3_1_8b(), H100, EngineSettings(**base))
    pcp = predict(llama_3_1_8b(), H100, EngineSettings(**base, prefill_context_parallel_size=2))
    assert pcp.num_blocks == plain.num_blocks
    assert pcp.max_concurrency == plain.max_concurrency
    assert pcp.kv_cache_tokens == plain.kv_cache_tokens


def test_before_0_21_the_token_line_is_multiplied_by_pcp_times_dcp() -> None:
    base = dict(vllm_version="0.19", tensor_parallel_size=4, max_model_len=32768)
    plain = predict(llama_3_1_8b(), H100, EngineSettings(**base))
    cp = predict(
        llama_3_1_8b(),
        H100,
        EngineSettings(**base, prefill_context_parallel_size=2, decode_context_parallel_size=2),
    )
    assert cp.num_blocks == plain.num_blocks
    assert cp.kv_cache_tokens == plain.num_blocks * 16 * 4  # (B // 1) × 16 × PCP × DCP
    assert cp.max_concurrency == plain.max_concurrency


@pytest.mark.parametrize(
    ("tp", "pcp", "dcp", "words"),
    [(4, 1, 3, "must be divisible by dcp_size=3"), (2, 2, 3, "span the PCP axis")],
)
def test_context_parallel_sizes_vllm_refuses(tp: int, pcp: int, dcp: int, words: str) -> None:
    s = EngineSettings(
        tensor_parallel_size=tp, prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp
    )
    with pytest.raises(BadInput, match=words):
        predict(llama_3_1_8b(), H100, s)


def test_dcp_over_sliding_window_layers_stops_startup() -> None:
    s = EngineSettings(vllm_version="0.32", tensor_parallel_size=8, decode_context_parallel_size=2)
    p = predict(gpt_oss_120b(), H100, s)
    assert [pr.message for pr in p.problems if pr.code == "dcp_sliding_window"] == [
        "DCP not support sliding window."
    ]
    assert not p.fits


# -- §14.2 KV offloading and connectors -------------------------------------------------------


def test_native_offload_prices_host_memory_and_keeps_the_gpu_pool() -> None:
    c = kv_connector(64.0, "native", None)
    assert c is not None and c.name == "OffloadingConnector"
    assert c.host_bytes == 64 * GIB and c.supports_hma
    base = dict(vllm_version="0.32", max_model_len=32768)
    plain = predict(llama_3_1_8b(), H100, EngineSettings(**base))
    offload = predict(llama_3_1_8b(), H100, EngineSettings(**base, kv_offloading_size=64.0))
    assert offload.num_blocks == plain.num_blocks
    assert offload.kv_cache_bytes == plain.kv_cache_bytes


def test_connectors_priced_or_named() -> None:
    sized = kv_connector(
        None,
        "native",
        '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",'
        ' "kv_connector_extra_config": {"cpu_bytes_to_use": 1000000000}}',
    )
    assert sized is not None and sized.host_bytes == 1_000_000_000
    lmcache = kv_connector(32.0, "lmcache", None)
    assert lmcache is not None and lmcache.name == "LMCacheMPConnector"
    assert lmcache.host_bytes is None and lmcache.unpriced and not lmcache.supports_hma
    multi = kv_connector(
        None,
        "native",
        '{"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": '
        '[{"kv_connector": "NixlConnector"}, {"kv_connector": "LMCacheConnectorV1"}]}}',
    )
    assert multi is not None and not multi.supports_hma


@pytest.mark.parametrize(
    ("size", "backend", "text", "words"),
    [
        (None, "native", "{not json", "is not valid JSON"),
        (None, "native", "[1, 2]", "must be a JSON object"),
        (None, "native", '{"kv_role": "kv_both"}', "names no kv_connector"),
        (-1.0, "native", None, "must be positive"),
        (8.0, "disk", None, "not a backend"),
    ],
)
def test_malformed_offload_flags(
    size: float | None, backend: str, text: str | None, words: str
) -> None:
    with pytest.raises(BadInput, match=words):
        kv_connector(size, backend, text)


def test_connector_without_hma_gives_sliding_layers_the_whole_context() -> None:
    lmcache = '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'
    s = EngineSettings(
        vllm_version="0.32",
        tensor_parallel_size=2,
        max_model_len=131072,
        kv_transfer_config=lmcache,
    )
    p = predict(gpt_oss_120b(), H100, s)
    # hybrid manager off: all 36 layers are full attention, one group of 36 layers, 8192 blocks
    assert p.num_kv_groups == 1
    assert p.max_concurrency == p.num_blocks / kvm.cdiv(131072, 16)
    nixl = predict(
        gpt_oss_120b(),
        H100,
        EngineSettings(
            **{
                **s.__dict__,
                "kv_transfer_config": ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'),
            }
        ),
    )
    assert nixl.num_kv_groups == 2  # NixlConnector supports the hybrid manager


def test_connector_without_hma_refuses_a_hybrid_mamba_model() -> None:
    s = EngineSettings(
        vllm_version="0.32", kv_offloading_size=16.0, kv_offloading_backend="lmcache"
    )
    p = predict(qwen3_next_80b(), H200, s)
    assert any(pr.code == "connector_without_hma" for pr in p.problems)
    assert not p.fits


# -- §14.3 sleep mode -------------------------------------------------------------------------


def test_sleep_levels_keep_context_nccl_and_graphs_on_the_gpu() -> None:
    level1, level2 = sleep_footprints(
        weights_bytes=15 * GIB,
        non_torch_bytes=GIB,
        non_torch_high_bytes=2 * GIB,
        graph_bytes=GIB // 2,
        graph_high_bytes=GIB,
        context_bytes=GIB // 2,
    )
    assert (level1.gpu_bytes, level1.gpu_bytes_high, level1.host_bytes) == (
        2 * GIB,
        3 * GIB + GIB // 2,
        15 * GIB,
    )
    assert (level2.gpu_bytes, level2.host_bytes) == (2 * GIB, 0)
    off1, off2 = sleep_footprints(
        weights_bytes=15 * GIB,
        non_torch_bytes=GIB,
        non_torch_high_bytes=GIB,
        graph_bytes=GIB // 2,
        graph_high_bytes=GIB,
        context_bytes=GIB // 2,
        offload_cudagraph=True,
    )
    assert off1.gpu_bytes == off2.gpu_bytes == GIB + GIB // 2
    assert (off1.host_bytes, off2.host_bytes) == (15 * GIB + GIB // 2, GIB // 2)


# -- §14.4 CUDA-graph settings ----------------------------------------------------------------


def test_compilation_config_graph_keys() -> None:
    g = read_compilation_config(
        '{"cudagraph_mode": "piecewise", "cudagraph_capture_sizes": [4, 1]}'
    )
    assert g == GraphSettings("PIECEWISE", (4, 1), None)
    assert capture_sizes(g, 256, 8192) == [1, 4]
    assert capture_sizes(GraphSettings(capture_sizes=(1, 8, 16384)), 256, 8192) == [1, 8]
    # default grid up to min(2 × 256, 512) = 512: 3 + 31 + 17 sizes
    assert len(capture_sizes(GraphSettings(), 256, 8192)) == 51
    assert capture_sizes(GraphSettings(max_capture_size=16), 256, 8192) == [1, 2, 4, 8, 16]
    assert capture_sizes(GraphSettings(mode="NONE"), 256, 8192) == []


@pytest.mark.parametrize(
    ("config", "sizes", "largest", "words"),
    [
        ('{"cudagraph_mode": "SOMETIMES"}', None, None, "not a mode vLLM has"),
        ('{"cudagraph_capture_sizes": [1]}', (2,), None, "mutually exclusive"),
        ('{"max_cudagraph_capture_size": 8}', None, 16, "mutually exclusive"),
        (None, (1, 2, 4), 8, "should be consistent"),
        ('{"cudagraph_capture_sizes": [0]}', None, None, "not a positive size"),
    ],
)
def test_graph_settings_vllm_refuses(
    config: str | None, sizes: tuple[int, ...] | None, largest: int | None, words: str
) -> None:
    with pytest.raises(BadInput, match=words):
        graph_settings(config, sizes, largest)


def test_graph_estimate_follows_the_switch_and_the_mode() -> None:
    model, base = llama_3_1_8b(), dict(vllm_version="0.32")
    on = predict(model, H100, EngineSettings(**base))
    off = predict(model, H100, EngineSettings(**base, estimate_cudagraphs=False))
    assert on.cudagraph.value_bytes > 0 and off.cudagraph.value_bytes == 0
    assert off.kv_cache_bytes == on.kv_cache_bytes + on.cudagraph.value_bytes
    opted_in = predict(model, H100, EngineSettings(vllm_version="0.19", estimate_cudagraphs=True))
    assert opted_in.cudagraph.value_bytes > 0  # 0.18–0.19: applied only when asked
    none = predict(
        model, H100, EngineSettings(**base, compilation_config='{"cudagraph_mode": "NONE"}')
    )
    assert none.cudagraph.value_bytes == 0
    few = predict(model, H100, EngineSettings(**base, cudagraph_capture_sizes=(1, 2, 4, 8)))
    assert 0 < few.cudagraph.value_bytes < on.cudagraph.value_bytes
    piecewise = predict(
        model, H100, EngineSettings(**base, compilation_config='{"cudagraph_mode": "PIECEWISE"}')
    )
    # one graph kind alone: not priced, the range runs down to none
    assert piecewise.cudagraph.low_bytes == 0
    assert piecewise.kv_cache_bytes_range[1] > on.kv_cache_bytes_range[1]


# -- §14.5 hybrid Mamba flags -----------------------------------------------------------------


def _qwen3_next_layers(**flags: object) -> kvm.LayerSpecsResult:
    return kvm.build_layer_specs(
        qwen3_next_80b(),
        tp=1,
        model_dtype="bfloat16",
        kv_cache_dtype="auto",
        block_size=16,
        era=resolve_era("0.32"),
        **flags,  # type: ignore[arg-type]
    )


def test_mamba_ssm_dtype_raises_the_attention_block() -> None:
    # conv (2·16·128 + 32·128) × 3 = 24,576 elements, SSM 32 × 128 × 128 = 524,288 elements;
    # attention page of one token 2 × 2 heads × 256 × 2 B = 2,048 B; 0.32 aligns to max(16, bs)
    default = _qwen3_next_layers()
    assert default.block_size == 16 * kvm.cdiv(24576 * 2 + 524288 * 2, 16 * 2048)  # 544
    fp32_ssm = _qwen3_next_layers(mamba_dtypes=("auto", "float32"))
    state = 24576 * 2 + 524288 * 4
    assert fp32_ssm.block_size == 16 * kvm.cdiv(state, 16 * 2048) == 1056
    mamba = next(s for s in fp32_ssm.specs if isinstance(s, kvm.Mamba))
    assert mamba.state_bytes == state
    assert mamba.page_size_bytes == 1056 * 2048
    fp32_all = _qwen3_next_layers(mamba_dtypes=("float32", "auto"))
    assert next(s for s in fp32_all.specs if isinstance(s, kvm.Mamba)).state_bytes == (
        24576 * 4 + 524288 * 4
    )


def test_max_num_seqs_above_mamba_blocks_is_refused_with_full_graphs() -> None:
    s = EngineSettings(vllm_version="0.32", kv_cache_memory_bytes=2 * GIB, max_num_seqs=512)
    p = predict(qwen3_next_80b(), H200, s)
    assert p.num_blocks < 512
    expected = (
        f"max_num_seqs (512) exceeds available Mamba cache blocks ({p.num_blocks}). Each decode "
        "sequence requires one Mamba cache block, so CUDA graph capture cannot proceed. Please "
        f"lower max_num_seqs to at most {p.num_blocks} or increase gpu_memory_utilization."
    )
    assert [pr.message for pr in p.problems if pr.code == "mamba_blocks_exceeded"] == [expected]
    assert not p.fits
    eager = predict(qwen3_next_80b(), H200, EngineSettings(**{**s.__dict__, "enforce_eager": True}))
    assert not any(pr.code == "mamba_blocks_exceeded" for pr in eager.problems)
    piecewise = predict(
        qwen3_next_80b(),
        H200,
        EngineSettings(**{**s.__dict__, "compilation_config": '{"cudagraph_mode": "PIECEWISE"}'}),
    )
    assert not any(pr.code == "mamba_blocks_exceeded" for pr in piecewise.problems)


def test_mamba_cache_mode_flag() -> None:
    with pytest.raises(BadInput, match="does not exist in vLLM 0.32"):
        predict(qwen3_next_80b(), H200, EngineSettings(vllm_version="0.32", mamba_cache_mode="all"))
    with pytest.raises(BadInput, match="not a mode vLLM has"):
        predict(qwen3_next_80b(), H200, EngineSettings(mamba_cache_mode="sometimes"))
    with pytest.raises(BadInput, match="not a dtype vLLM takes"):
        predict(qwen3_next_80b(), H200, EngineSettings(mamba_cache_dtype="fp8"))
    # without prefix caching vLLM resets the mode to none: one state per request
    off = predict(
        qwen3_next_80b(),
        H200,
        EngineSettings(vllm_version="0.32", enable_prefix_caching=False, mamba_cache_mode="align"),
    )
    on = predict(
        qwen3_next_80b(),
        H200,
        EngineSettings(vllm_version="0.32", enable_prefix_caching=True, mamba_cache_mode="none"),
    )
    assert on.max_concurrency < off.max_concurrency  # 'none' with prefix caching becomes 'align'
