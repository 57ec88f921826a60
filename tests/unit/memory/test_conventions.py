"""Conventions of the facts layer that the memory model must honour.

Each test builds its ModelSpec the way users get one (catalogue entry or a config.json read by
``spec_from_config``) and checks the memory model's handling of that convention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from oomguard.errors import UnsupportedArchitecture
from oomguard.facts.config_reader import spec_from_config
from oomguard.facts.quant import apply_quantization_flag
from oomguard.facts.resolve import resolve_model, resolve_model_with_quantization
from oomguard.memory import kv as kvm
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import AttentionKind, GPUSpec, LayerSpec, MambaStateSpec, QuantSpec
from oomguard.memory.versions import resolve_era
from oomguard.memory.weights import (
    mxfp4_expert_padding,
    resolve_model_dtype,
    weight_bytes_per_stage,
)

from .builders import dense, qwen3_next_80b

GIB = 2**30
H100 = GPUSpec(
    "H100 SXM", int(79.19 * GIB), 80, compute_capability="9.0", device_name="NVIDIA H100 80GB HBM3"
)
T4 = GPUSpec("T4", int(14.57 * GIB), 16, compute_capability="7.5", device_name="Tesla T4")


def _falcon_h1_config() -> dict[str, object]:
    """A Falcon-H1-shaped config (attention and Mamba2 side by side in every layer)."""
    return {
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        "hidden_size": 1024,
        "num_hidden_layers": 36,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 2048,
        "mamba_n_heads": 24,
        "mamba_d_head": 64,
        "mamba_d_ssm": 1536,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "vocab_size": 32784,
        "max_position_embeddings": 16384,
        "torch_dtype": "bfloat16",
    }


def _opt_125m_config() -> dict[str, object]:
    """facebook/opt-125m config.json (learned positions, fp16)."""
    return {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 768,
        "do_layer_norm_before": True,
        "torch_dtype": "float16",
        "enable_bias": True,
    }


# -- cross-attention ---------------------------------------------------------------------------


def test_mllama_is_refused_after_its_removal_and_v0_before() -> None:
    model = resolve_model("meta-llama/Llama-3.2-11B-Vision", allow_hub=False)
    assert sum(layer.kind is AttentionKind.CROSS for layer in model.layers) == 8
    with pytest.raises(UnsupportedArchitecture, match="supported in vLLM until v0.10.2"):
        predict(model, H100, EngineSettings(vllm_version="0.19", max_model_len=8192))
    # 0.10: encoder-decoder models fall back to the V0 engine (one block size for all layers)
    p = predict(model, H100, EngineSettings(vllm_version="0.10", max_model_len=8192))
    assert p.era.engine == "v0"
    assert p.bytes_per_block == 16 * 40 * 2 * 8 * 128 * 2
    assert any(line.startswith("# cuda blocks:") for line in p.log_lines)


def test_cross_attention_holds_the_encoder_budget_per_request() -> None:
    # a V1 encoder-decoder-style decoder: 4 self-attention + 2 cross-attention layers
    specs = tuple(
        LayerSpec(AttentionKind.CROSS if i in (1, 4) else AttentionKind.FULL, 8, 128)
        for i in range(6)
    )
    model = dense(
        "cross-test",
        layers=6,
        hidden=1024,
        inter=4096,
        heads=8,
        kv=8,
        head=128,
        vocab=32000,
        max_len=4096,
        layer_specs=specs,
    )
    settings = EngineSettings(
        vllm_version="0.32",
        max_model_len=4096,
        max_num_batched_tokens=1000,
        max_num_seqs=8,
        kv_cache_memory_bytes=2 * GIB,
    )
    p = predict(model, H100, settings)
    page = 16 * 8 * 2 * 128 * 2
    # groups: self-attention (4 layers → 2 groups of 2) and cross (1 group of 2), page × 2
    assert p.bytes_per_block == page * 2
    blocks = 2 * GIB // (page * 2)
    assert p.num_blocks == blocks
    # per request: 2 full groups × cdiv(4096, 16) + 1 cross group × cdiv(1000 encoder tokens, 16)
    assert p.max_concurrency == pytest.approx(blocks / (2 * 256 + 63))


# -- state entries longer than num_layers --------------------------------------------------


def test_falcon_h1_two_state_entries_per_layer_survive_projection_and_pp() -> None:
    model = spec_from_config(_falcon_h1_config(), name="falcon-h1-test", source="test")
    assert len(model.layers) == 2 * model.num_layers
    assert kvm.state_entry_layer(model)[:4] == (0, 0, 1, 1)
    full = predict(model, H100, EngineSettings(vllm_version="0.19", max_model_len=16384))
    # all 36 attention layers count (nothing dropped by the worker projection)
    assert full.kv_bytes_per_token == 36 * 2 * 2 * 64 * 2
    assert full.fits
    staged = predict(
        model,
        H100,
        EngineSettings(vllm_version="0.19", max_model_len=16384, pipeline_parallel_size=2),
    )
    assert [s.num_layers for s in staged.stages] == [18, 18]
    # each stage's block holds its own 18 attention + 18 Mamba entries: half the TP=1 block
    assert staged.stages[0].bytes_per_block * 2 == full.bytes_per_block
    assert staged.stages[1].bytes_per_block * 2 == full.bytes_per_block


def test_nemotron_h_pattern_blocks_without_state_are_skipped() -> None:
    model = resolve_model("nvidia/Nemotron-H-56B-Base-8K", allow_hub=False)
    assert len(model.layers) == model.num_layers
    kinds = {layer.kind for layer in model.layers}
    assert AttentionKind.NONE in kinds and AttentionKind.MAMBA in kinds
    p = predict(
        model, H100, EngineSettings(vllm_version="0.19", tensor_parallel_size=4, max_model_len=8192)
    )
    n_attn = sum(layer.kind is AttentionKind.FULL for layer in model.layers)
    per_rank_heads = kvm.kv_heads_per_rank(model.num_kv_heads, 4)
    assert p.kv_bytes_per_token == n_attn * 2 * per_rank_heads * model.head_size * 2


# -- parameter groups ----------------------------------------------------------------------


def test_opt_learned_positions_are_replicated_on_the_first_stage() -> None:
    model = spec_from_config(_opt_125m_config(), name="facebook/opt-125m", source="test")
    pos = next(g for g in model.params if g.name == "pos_embed")
    assert pos.count == (2048 + 2) * 768
    w1 = weight_bytes_per_stage(model, model_dtype="float16", tp=1)
    w2 = weight_bytes_per_stage(model, model_dtype="float16", tp=2)
    without = dataclasses.replace(model, params=tuple(g for g in model.params if g is not pos))
    w2_without = weight_bytes_per_stage(without, model_dtype="float16", tp=2)
    assert w2.max_bytes - w2_without.max_bytes == pos.count * 2  # not divided by TP
    staged = weight_bytes_per_stage(model, model_dtype="float16", pp=2)
    staged_without = weight_bytes_per_stage(without, model_dtype="float16", pp=2)
    assert staged.per_stage_bytes[0] - staged_without.per_stage_bytes[0] == pos.count * 2
    assert staged.per_stage_bytes[1] == staged_without.per_stage_bytes[1]
    assert w1.max_bytes > w2.max_bytes


def test_vision_tower_is_first_stage_tp_sharded_and_never_quantized() -> None:
    model = resolve_model("Qwen/Qwen2.5-VL-7B-Instruct", allow_hub=False)
    vision = next(g for g in model.params if g.name == "vision")
    without = dataclasses.replace(model, params=tuple(g for g in model.params if g is not vision))

    def delta(m_quant: QuantSpec, **kw: Any) -> list[int]:
        a = weight_bytes_per_stage(
            dataclasses.replace(model, quant=m_quant), model_dtype="bfloat16", **kw
        )
        b = weight_bytes_per_stage(
            dataclasses.replace(without, quant=m_quant), model_dtype="bfloat16", **kw
        )
        return [x - y for x, y in zip(a.per_stage_bytes, b.per_stage_bytes, strict=True)]

    assert delta(QuantSpec()) == [vision.count * 2]
    assert delta(QuantSpec(), tp=2) == [vision.count]
    assert delta(QuantSpec(), pp=2) == [vision.count * 2, 0]
    awq = resolve_model("Qwen/Qwen2.5-VL-7B-Instruct-AWQ", allow_hub=False).quant
    assert awq.method == "awq"
    assert delta(awq) == [vision.count * 2]  # still bf16 under AWQ


def test_mtp_weights_load_only_with_mtp_speculation() -> None:
    model = resolve_model("deepseek-ai/DeepSeek-V3", allow_hub=False)
    mtp = next(g for g in model.params if g.name == "mtp")
    kw: dict[str, Any] = dict(model_dtype="bfloat16", tp=8, pp=2)
    plain = weight_bytes_per_stage(model, **kw)
    spec = weight_bytes_per_stage(model, load_mtp=True, **kw)
    assert plain.per_stage_bytes[0] == spec.per_stage_bytes[0]
    extra = spec.per_stage_bytes[1] - plain.per_stage_bytes[1]
    assert mtp.count / 8 * 0.5 < extra < mtp.count / 8 * 1.1  # fp8 checkpoint, last stage only
    s = EngineSettings(vllm_version="0.19", tensor_parallel_size=8, max_model_len=8192)
    default = predict(model, H100, s)
    with_mtp = predict(model, H100, dataclasses.replace(s, speculative_method="deepseek_mtp"))
    assert with_mtp.weights.value_bytes > default.weights.value_bytes


# -- dtypes and checkpoint bytes -------------------------------------------------------------


def test_fp32_checkpoint_loads_in_16_bit_under_auto() -> None:
    config = dict(_opt_125m_config())
    del config["torch_dtype"]
    model = spec_from_config(config, name="opt-fp32", source="test")
    assert model.dtype == "float32"
    assert resolve_model_dtype(model, "auto", "9.0") == "bfloat16"
    assert resolve_model_dtype(model, "auto", "7.5") == "float16"  # no bf16 before Ampere
    assert resolve_model_dtype(model, "float32", "9.0") == "float32"
    p32 = predict(model, T4, EngineSettings(vllm_version="0.19", dtype="float32"))
    p16 = predict(model, T4, EngineSettings(vllm_version="0.19"))
    assert p16.kv_bytes_per_token * 2 == p32.kv_bytes_per_token
    assert p16.weights.value_bytes < 0.55 * p32.weights.value_bytes


def test_checkpoint_total_without_dtype_split_is_priced_at_the_checkpoint_dtype() -> None:
    config = dict(_opt_125m_config())
    del config["torch_dtype"]  # a float32 checkpoint
    base = spec_from_config(config, name="opt-fp32", source="test")
    model = dataclasses.replace(base, checkpoint_bytes_by_dtype={"ALL": base.total_params * 4})
    w = weight_bytes_per_stage(model, model_dtype="bfloat16")
    assert "scaled by checkpoint element count (1.0000)" in w.basis


# -- quantization through the facts layer ----------------------------------------------------


def test_quantized_names_and_the_quantization_flag() -> None:
    base = resolve_model("meta-llama/Llama-3.1-8B-Instruct", allow_hub=False)
    online = resolve_model_with_quantization(
        "meta-llama/Llama-3.1-8B-Instruct", "fp8", allow_hub=False
    )
    assert online.quant.method == "fp8"
    assert apply_quantization_flag(base.quant, None) == base.quant
    s = EngineSettings(vllm_version="0.19", max_model_len=8192)
    w_base = predict(base, H100, s).weights.gib
    w_fp8 = predict(online, H100, s).weights.gib
    assert w_base == pytest.approx(14.99, abs=0.01)  # logged "Model loading took 14.99 GiB"
    assert w_fp8 == pytest.approx(8.49, abs=0.02)  # logged 8.49 GiB with --quantization fp8
    awq = resolve_model("Qwen/Qwen3-8B-AWQ", allow_hub=False)
    assert awq.quant.method == "awq" and not awq.checkpoint_bytes_by_dtype
    assert (
        predict(awq, H100, s).weights.gib
        < 0.45 * predict(resolve_model("Qwen/Qwen3-8B", allow_hub=False), H100, s).weights.gib
    )


# -- Mamba per-block caching and mxfp4 padding -----------------------------------------------


def test_mamba_all_mode_block_follows_the_model_chunk_size() -> None:
    model = qwen3_next_80b()
    era = resolve_era("0.26")

    def block(chunk: int | None) -> int:
        layers = tuple(
            dataclasses.replace(ly, mamba=dataclasses.replace(ly.mamba, mamba_chunk_size=chunk))
            if ly.mamba is not None
            else ly
            for ly in model.layers
        )
        built = kvm.build_layer_specs(
            dataclasses.replace(model, layers=layers),
            tp=1,
            model_dtype="bfloat16",
            kv_cache_dtype="auto",
            block_size=16,
            era=era,
            mamba_cache_mode="all",
        )
        return built.block_size

    # m = 1,097,728 B, a1 = 2048 B → 536 tokens of attention page; rounded up to lcm(chunk, 16)
    assert block(None) == 768  # fallback chunk 256 → 3 × 256
    assert block(128) == 640  # 5 × 128
    assert block(64) == 576  # 9 × 64
    assert isinstance(MambaStateSpec.__dataclass_fields__["mamba_chunk_size"].default, type(None))


def test_mxfp4_padding_rounds_the_per_rank_intermediate_size() -> None:
    # gpt-oss: hidden 2880 → 3072; intermediate per rank 2880 → 2944 (TP1), 1440 → 1536 (TP2)
    assert mxfp4_expert_padding(2880, 2880, shards=1) == pytest.approx(3072 / 2880 * 2944 / 2880)
    assert mxfp4_expert_padding(2880, 2880, shards=2) == pytest.approx(3072 / 2880 * 1536 / 1440)
    assert mxfp4_expert_padding(
        2880, 2880, shards=2, pad_intermediate=resolve_era("0.11").mxfp4_pad_intermediate
    ) == pytest.approx(3072 / 2880)
    model = resolve_model("openai/gpt-oss-20b", allow_hub=False)
    s = EngineSettings(vllm_version="0.19", max_model_len=8192)
    tp1 = predict(model, H100, s).weights.gib
    tp2 = predict(model, H100, dataclasses.replace(s, tensor_parallel_size=2)).weights.gib
    assert tp1 == pytest.approx(13.64, rel=0.01)  # logged 13.64 GiB (vLLM 0.19, H100, TP=1)
    assert tp2 == pytest.approx(7.01, rel=0.012)  # logged 7.01 GiB (TP=2)


def test_release_differences_are_era_fields() -> None:
    # each behaviour that changed between releases is read from the era row, not a version check
    old, mid, new = resolve_era("0.10"), resolve_era("0.17"), resolve_era("0.30")
    assert (old.hopper_mla_block, mid.hopper_mla_block, new.hopper_mla_block) == (64, 64, 16)
    assert not old.cpu_hybrid_kv_manager and mid.cpu_hybrid_kv_manager
    assert not old.refuses_removed_architectures and new.refuses_removed_architectures
    assert (mid.non_torch_form, new.non_torch_form) == ("v1", "late")
    assert (resolve_era("0.14").mamba_prefix_mode, new.mamba_prefix_mode) == ("all", "align")
    assert not mid.rocm_cudagraph_profiled and new.rocm_cudagraph_profiled
    assert not resolve_era("0.11").mxfp4_pad_intermediate and new.mxfp4_pad_intermediate
    assert not mid.full_attention_page_padding and new.full_attention_page_padding
    assert not mid.cpu_mla_block_16 and new.cpu_mla_block_16
