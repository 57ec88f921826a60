"""Byte-exact KV pages, groups and per-request blocks of the 2025–2026 architectures.

Each expected figure is worked out by hand from the model's published config and vLLM's rules
(vllm-memory §4–§5): page = 2 (K and V) × block × KV heads × head size × dtype bytes per layer,
layers with smaller pages get a larger block (``unify_kv_cache_spec_page_size``), layers are
bucketed by spec and grouped by the smallest bucket, layers that share another layer's KV get
no spec, MLA keeps one latent per token, Gated DeltaNet state is one page per request.
"""

from __future__ import annotations

from oomguard.facts.catalogue import find_entry
from oomguard.memory import kv as kvm
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.memory.versions import resolve_era

GIB = 2**30
H100 = GPUSpec(
    "H100 SXM", int(79.19 * GIB), 80, compute_capability="9.0", device_name="NVIDIA H100 80GB HBM3"
)


def _spec(model_id: str) -> ModelSpec:
    return find_entry(model_id).spec()


def _layout(
    model: ModelSpec, era: str = "0.19", tp: int = 1, kv_dtype: str = "auto", block: int = 16
) -> tuple[kvm.LayerSpecsResult, kvm.KVLayout]:
    e = resolve_era(era)
    built = kvm.build_layer_specs(
        model, tp=tp, model_dtype="bfloat16", kv_cache_dtype=kv_dtype, block_size=block, era=e
    )
    specs = [(i, s) for i, s in enumerate(built.specs) if s is not None]
    return built, kvm.group_layers(specs, e)


def test_gemma_4_31b_two_head_sizes_unify_by_block_size() -> None:
    # 60 layers, every 6th full: 50 sliding (16 KV heads × 256) and 10 full (4 KV heads × 512)
    model = _spec("google/gemma-4-31B-it")
    built, layout = _layout(model, era="0.20")
    sliding = [s for s in built.specs if type(s) is kvm.SlidingWindow]
    full = [s for s in built.specs if type(s) is kvm.FullAttention]
    assert (len(sliding), len(full)) == (50, 10)
    assert sliding[0].page_size_bytes == 2 * 16 * 16 * 256 * 2 == 262_144
    assert full[0].page_size_bytes == 2 * 16 * 4 * 512 * 2 == 131_072
    # the full layers' page is half the sliding one: their block doubles to 32 tokens
    assert layout.num_groups == 6  # 5 sliding groups of 10 + 1 full group of 10
    assert layout.bytes_per_block == 10 * 262_144
    assert not layout.padding_warnings
    full_group = next(g for g in layout.groups if type(g.spec) is kvm.FullAttention)
    assert full_group.spec.block_size == 32
    # one request of 8,192 tokens with 1,024-token steps: 8192 / 32 = 256 full blocks, and per
    # sliding group cdiv(min(1023 + 1024, 8192), 16) + 1 = 129 blocks
    assert layout.blocks_per_request(kvm.RequestBound(8192, 1024)) == 256 + 5 * 129


def test_gemma_4_26b_a4b_pages_and_groups() -> None:
    # 30 layers: 25 sliding (8 KV heads × 256), 5 full (2 KV heads × 512)
    model = _spec("google/gemma-4-26B-A4B-it")
    built, layout = _layout(model, era="0.20")
    pages = sorted({s.page_size_bytes for s in built.specs if s is not None})
    assert pages == [2 * 16 * 2 * 512 * 2, 2 * 16 * 8 * 256 * 2] == [65_536, 131_072]
    assert layout.num_groups == 6 and layout.bytes_per_block == 5 * 131_072


def test_gemma_4_e2b_keeps_fifteen_caches_with_sliding_blocks_doubled() -> None:
    # 35 layers, every 5th full; the last 20 reuse earlier layers' KV: 12 sliding caches of
    # 1 KV head × 256 and 3 full ones of 1 × 512 (gemma.cpp ConfigGemma4_2B_LM)
    model = _spec("google/gemma-4-E2B-it")
    built, layout = _layout(model, era="0.20")
    assert sum(s is None for s in built.specs) == 20
    sliding = [s for s in built.specs if type(s) is kvm.SlidingWindow]
    full = [s for s in built.specs if type(s) is kvm.FullAttention]
    assert (len(sliding), len(full)) == (12, 3)
    assert sliding[0].page_size_bytes == 2 * 16 * 1 * 256 * 2 == 16_384
    assert full[0].page_size_bytes == 2 * 16 * 1 * 512 * 2 == 32_768
    # here the sliding page is the smaller one: its block doubles to 32 tokens; groups of 3
    assert layout.num_groups == 5 and layout.bytes_per_block == 3 * 32_768
    assert {g.spec.block_size for g in layout.groups if type(g.spec) is kvm.SlidingWindow} == {32}
    # 8,192 tokens, 1,024-token steps: 512 full blocks + per sliding group
    # cdiv(min(511 + 1024, 8192), 32) + 1 = 49
    assert layout.blocks_per_request(kvm.RequestBound(8192, 1024)) == 512 + 4 * 49


def test_gemma_4_e4b_keeps_twenty_four_caches() -> None:
    # 42 layers, every 6th full; the last 18 share: 20 sliding caches of 2 KV heads × 256 and
    # 4 full ones of 2 × 512 (gemma.cpp ConfigGemma4_E4B_LM)
    model = _spec("google/gemma-4-E4B-it")
    built, layout = _layout(model, era="0.20")
    assert sum(s is None for s in built.specs) == 18
    pages = sorted(s.page_size_bytes for s in built.specs if s is not None)
    assert pages == [2 * 16 * 2 * 256 * 2] * 20 + [2 * 16 * 2 * 512 * 2] * 4
    assert layout.num_groups == 6 and layout.bytes_per_block == 4 * 65_536
    assert layout.blocks_per_request(kvm.RequestBound(8192, 1024)) == 512 + 5 * 49
    p = predict(
        model,
        H100,
        EngineSettings(
            vllm_version="0.20", max_model_len=8192, kv_cache_memory_bytes=1000 * 4 * 65_536
        ),
    )
    # 1,000 blocks shared by 6 groups: vLLM reports (1000 // 6) × 16 tokens
    assert p.num_blocks == 1000 and p.kv_cache_tokens == (1000 // 6) * 16 == 2656


def test_gemma_3n_shared_kv_layers_have_no_cache() -> None:
    # 35 layers; the last 15 reuse the KV of earlier layers: 20 caches of 2 KV heads × 256
    model = _spec("google/gemma-3n-E4B-it")
    built, layout = _layout(model, era="0.20")
    assert sum(s is None for s in built.specs) == 15
    kept = [s for s in built.specs if s is not None]
    assert len(kept) == 20 and {s.page_size_bytes for s in kept} == {2 * 16 * 2 * 256 * 2}
    # 16 sliding (512-token window) + 4 full: groups of 4
    assert layout.num_groups == 5 and layout.bytes_per_block == 4 * 32_768


def test_exaone_4_32b_three_local_layers_per_global() -> None:
    model = _spec("LGAI-EXAONE/EXAONE-4.0-32B")
    built, layout = _layout(model)
    windows = [getattr(s, "sliding_window", None) for s in built.specs]
    assert windows[:4] == [4096, 4096, 4096, None] and windows.count(None) == 16
    assert {s.page_size_bytes for s in built.specs if s} == {2 * 16 * 8 * 128 * 2}
    assert layout.num_groups == 4 and layout.bytes_per_block == 16 * 65_536
    p = predict(
        model,
        H100,
        EngineSettings(
            vllm_version="0.19",
            max_model_len=32768,
            max_num_batched_tokens=2048,
            kv_cache_memory_bytes=4096 * 16 * 65_536,
        ),
    )
    assert p.num_blocks == 4096 and p.kv_cache_tokens == 4096 * 16 // 4
    # per request: 32768 / 16 = 2,048 full blocks + per sliding group
    # cdiv(min(4095 + 2048, 32768), 16) + 1 = 385 blocks
    assert abs(p.max_concurrency - 4096 / (2048 + 3 * 385)) < 1e-12


def test_exaone_4_1_2b_is_global_only() -> None:
    model = _spec("LGAI-EXAONE/EXAONE-4.0-1.2B")
    built, layout = _layout(model)
    assert all(isinstance(s, kvm.FullAttention) for s in built.specs)
    assert layout.num_groups == 1 and layout.bytes_per_block == 30 * 2 * 16 * 8 * 64 * 2


def test_glm_4_5_air_one_full_group_without_the_mtp_layer() -> None:
    model = _spec("zai-org/GLM-4.5-Air")
    built, layout = _layout(model)
    assert len(built.specs) == 46  # the MTP layer has no cache unless it drafts
    assert layout.num_groups == 1 and layout.bytes_per_block == 46 * 2 * 16 * 8 * 128 * 2
    built8, layout8 = _layout(model, tp=8)
    assert layout8.bytes_per_block == 46 * 2 * 16 * 1 * 128 * 2  # 8 KV heads over 8 ranks


def test_qwen3_5_27b_float32_ssm_state_sets_the_block() -> None:
    # Gated DeltaNet: 16 QK heads × 128, 48 V heads × 128, conv kernel 4; attention 4 KV × 256.
    # conv state 3 × (2·16·128 + 48·128) bf16 = 61,440 B; SSM state 48 × 128 × 128 float32
    # (mamba_ssm_dtype) = 3,145,728 B → 3,207,168 B; attention 4,096 B per token → block
    # raised to 783 tokens, aligned up to 784 (a multiple of 16); Mamba page padded to it.
    model = _spec("Qwen/Qwen3.5-27B")
    built, layout = _layout(model, era="0.19")
    mamba = next(s for s in built.specs if isinstance(s, kvm.Mamba))
    assert mamba.raw_page_size_bytes == 61_440 + 3_145_728 == 3_207_168
    assert built.block_size == 784
    assert mamba.page_size_bytes == 784 * 4096
    assert f"{built.mamba_padding_pct:.2f}" == "0.13"
    # 16 full + 48 linear layers: groups of 16 → 1 attention + 3 Mamba groups
    assert layout.num_groups == 4 and layout.bytes_per_block == 16 * 784 * 4096


def test_deepseek_v3_2_sparse_mla_and_indexer_cache() -> None:
    model = _spec("deepseek-ai/DeepSeek-V3.2")
    # fp8_ds_mla: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE = 656 B; indexer 128 + 4 = 132 B
    built, layout = _layout(model, era="0.13", block=64)
    mla = [s for s in built.specs if isinstance(s, kvm.MLA)]
    assert {s.page_size_bytes for s in mla} == {64 * 656, 64 * 132}
    assert layout.bytes_per_block == 61 * 64 * (656 + 132)
    # from 0.14 the latent stays in the model dtype unless an fp8 cache is asked for
    built14, layout14 = _layout(model, era="0.14", block=64)
    assert layout14.bytes_per_block == 61 * 64 * (576 * 2 + 132)
    _, fp8 = _layout(model, era="0.14", block=64, kv_dtype="fp8")
    assert fp8.bytes_per_block == 61 * 64 * (656 + 132)
    # TP does not split MLA latents or indexer keys
    _, tp8 = _layout(model, era="0.14", block=64, tp=8)
    assert tp8.bytes_per_block == layout14.bytes_per_block


def test_deepseek_v3_2_takes_64_token_blocks() -> None:
    model = _spec("deepseek-ai/DeepSeek-V3.2")
    p = predict(
        model,
        H100,
        EngineSettings(
            vllm_version="0.19",
            tensor_parallel_size=8,
            max_model_len=32768,
            kv_cache_memory_bytes=20 * GIB,
        ),
    )
    assert p.block_size == 64


def test_llava_next_and_qwen3_vl_text_pages() -> None:
    llava = _spec("llava-hf/llava-v1.6-mistral-7b-hf")
    _, layout = _layout(llava)
    assert layout.bytes_per_block == 32 * 2 * 16 * 8 * 128 * 2  # Mistral-7B: 32 layers, 8 KV
    assert llava.vision is not None and llava.vision.max_tokens_per_item == 576 + 2304 + 48
    vl = _spec("Qwen/Qwen3-VL-30B-A3B-Instruct")
    _, layout_vl = _layout(vl)
    assert layout_vl.bytes_per_block == 48 * 2 * 16 * 4 * 128 * 2
    assert vl.vision is not None and vl.vision.max_tokens_per_item == 16_384


def test_granite_4_micro_all_attention_is_not_hybrid() -> None:
    model = _spec("ibm-granite/granite-4.0-micro")
    built, layout = _layout(model)
    assert built.block_size_raised_from is None and built.mamba_padding_pct is None
    assert layout.num_groups == 1 and layout.bytes_per_block == 40 * 2 * 16 * 8 * 64 * 2
