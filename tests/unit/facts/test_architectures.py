"""Layer kinds and dimensions the memory model depends on, per architecture family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.facts.config_reader import derive_max_model_len, spec_from_config
from oomguard.memory.spec import AttentionKind, MambaVariant, ParamSharding

DATA = Path(__file__).parent / "data"


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


# openai/gpt-oss-20b config.json (https://huggingface.co/openai/gpt-oss-20b), memory fields
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 64,
    "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 24, "num_local_experts": 32,
    "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "vocab_size": 201088,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn",
                                                       "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]},
}  # fmt: skip

# deepseek-ai/DeepSeek-V3 config.json (https://huggingface.co/deepseek-ai/DeepSeek-V3), memory
# fields
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
    "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}  # fmt: skip

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json, memory fields
QWEN3_NEXT: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_gemma3_sliding_pattern_every_sixth_layer_global() -> None:
    spec = spec_from_config(_fixture("google__gemma-3-27b-it"), name="g3", source="t")
    kinds = [layer.kind for layer in spec.layers]
    assert len(kinds) == 62
    full = [i for i, k in enumerate(kinds) if k is AttentionKind.FULL]
    assert full == [i for i in range(62) if (i + 1) % 6 == 0]
    sliding = [layer for layer in spec.layers if layer.kind is AttentionKind.SLIDING]
    assert {layer.sliding_window for layer in sliding} == {1024}
    assert spec.head_size == 128 and spec.num_kv_heads == 16
    assert spec.vocab_size == 262208  # transformers default: the config omits it
    assert spec.derived_max_model_len == 131072  # gemma3: rope factor not applied again
    assert spec.vision is not None and spec.vision.max_tokens_per_item == 256
    assert spec.tie_word_embeddings and "lm_head" not in {g.name for g in spec.params}


def test_gemma3_explicit_layer_types_win() -> None:
    config = _fixture("google__gemma-3-27b-it")
    config["text_config"]["layer_types"] = ["full_attention"] * 62
    spec = spec_from_config(config, name="g3", source="t")
    assert all(layer.kind is AttentionKind.FULL for layer in spec.layers)


def test_gpt_oss_alternates_sliding_128_and_full() -> None:
    spec = spec_from_config(GPT_OSS_20B, name="openai/gpt-oss-20b", source="t")
    kinds = [layer.kind for layer in spec.layers]
    assert kinds == [AttentionKind.SLIDING, AttentionKind.FULL] * 12
    assert spec.layers[0].sliding_window == 128 and spec.layers[0].head_size == 64
    assert spec.moe is not None and (spec.moe.num_experts, spec.moe.experts_per_token) == (32, 4)
    assert abs(spec.total_params / 20_914_757_184 - 1) < 1e-4  # HF safetensors metadata: 20.9B
    assert spec.derived_max_model_len == 131072  # yarn: factor not multiplied (vLLM 0.32)
    assert spec.quant.method == "mxfp4"
    assert (
        "attn_qo" in spec.quant.unquantized_groups
        and "experts" not in spec.quant.unquantized_groups
    )


def test_llama4_chunked_local_with_every_fourth_layer_global_nope() -> None:
    spec = spec_from_config(
        _fixture("meta-llama__Llama-4-Scout-17B-16E-Instruct"), name="scout", source="t"
    )
    kinds = [layer.kind for layer in spec.layers]
    assert len(kinds) == 48
    assert [i for i, k in enumerate(kinds) if k is AttentionKind.FULL] == list(range(3, 48, 4))
    chunked = [layer for layer in spec.layers if layer.kind is AttentionKind.CHUNKED]
    assert len(chunked) == 36 and {layer.attention_chunk_size for layer in chunked} == {8192}
    assert (
        spec.moe is not None and spec.moe.num_moe_layers == 48 and spec.moe.num_shared_experts == 1
    )
    assert spec.vision is not None and spec.vision.max_tokens_per_item == 17 * 144
    assert spec.derived_max_model_len == 10485760  # llama3 rope: factor not applied


def test_deepseek_v3_mla_latent_576_unsharded_with_mtp() -> None:
    spec = spec_from_config(DEEPSEEK_V3, name="deepseek-ai/DeepSeek-V3", source="t")
    assert all(layer.kind is AttentionKind.MLA for layer in spec.layers)
    assert {(layer.num_kv_heads, layer.head_size) for layer in spec.layers} == {(1, 576)}
    assert spec.num_mtp_layers == 1 and spec.num_layers == 61
    groups = {g.name: g for g in spec.params}
    main = spec.total_params - groups["mtp"].count
    assert abs(main / 671e9 - 1) < 0.005  # 671B main model
    assert abs(spec.total_params / 685e9 - 1) < 0.005  # 685B with the MTP module
    assert spec.moe is not None and spec.moe.num_moe_layers == 58
    assert spec.quant.method == "fp8" and spec.quant.scale_granularity == "block"
    assert spec.derived_max_model_len == 163840


def test_qwen3_next_gdn_dims_and_full_attention_interval() -> None:
    spec = spec_from_config(QWEN3_NEXT, name="q3n", source="t")
    full = [i for i, ly in enumerate(spec.layers) if ly.kind is AttentionKind.FULL]
    assert full == list(range(3, 48, 4))
    gdn = [ly.mamba for ly in spec.layers if ly.kind is AttentionKind.MAMBA]
    assert len(gdn) == 36
    m = gdn[0]
    assert m is not None and m.variant is MambaVariant.GATED_DELTA_NET
    assert (m.num_k_heads, m.head_k_dim, m.num_v_heads, m.head_v_dim, m.conv_kernel) == (
        16,
        128,
        32,
        128,
        4,
    )
    assert (spec.num_kv_heads, spec.head_size) == (2, 256)
    assert abs(spec.total_params / 80e9 - 1) < 0.01


def test_jamba_attention_every_eighth_layer_at_offset_four() -> None:
    spec = spec_from_config(_fixture("ai21labs__AI21-Jamba-1.5-Mini"), name="jamba", source="t")
    attn = [i for i, ly in enumerate(spec.layers) if ly.kind is AttentionKind.FULL]
    assert attn == [4, 12, 20, 28]
    mamba = [ly.mamba for ly in spec.layers if ly.kind is AttentionKind.MAMBA]
    assert len(mamba) == 28 and mamba[0] is not None
    assert (mamba[0].variant, mamba[0].intermediate_size, mamba[0].state_size) == (
        MambaVariant.MAMBA1,
        8192,
        16,
    )
    assert spec.moe is not None and spec.moe.num_moe_layers == 16 and spec.is_hybrid


def test_mistral_v01_model_level_window_applies_to_every_layer() -> None:
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "sliding_window": 4096,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    spec = spec_from_config(config, name="mistralai/Mistral-7B-v0.1", source="t")
    assert {(ly.kind, ly.sliding_window) for ly in spec.layers} == {(AttentionKind.SLIDING, 4096)}
    assert abs(spec.total_params / 7_241_732_096 - 1) < 1e-6  # HF metadata of Mistral-7B-v0.1
    config["sliding_window"] = None
    assert {ly.kind for ly in spec_from_config(config, name="m", source="t").layers} == {
        AttentionKind.FULL
    }


def test_param_groups_carry_sharding_and_vocab_rows() -> None:
    spec = spec_from_config(DEEPSEEK_V3, name="d", source="t")
    groups = {g.name: g for g in spec.params}
    assert groups["embed"].sharding is ParamSharding.VOCAB and groups["embed"].rows == 129280
    assert groups["embed"].cols == 7168 and groups["embed"].stage == "first"
    assert groups["lm_head"].stage == "last" and groups["experts"].sharding is ParamSharding.EXPERTS
    assert (
        groups["router"].sharding is ParamSharding.REPLICATED and not groups["router"].quantizable
    )


def test_derived_max_model_len_rules() -> None:
    assert (
        derive_max_model_len(
            {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}},
            "llama",
        )
        == 8192
    )
    assert (
        derive_max_model_len(
            {
                "max_position_embeddings": 4096,
                "rope_scaling": {"rope_type": "dynamic", "factor": 4},
            },
            "llama",
        )
        == 16384
    )
    assert (
        derive_max_model_len(
            {
                "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "llama3", "factor": 8},
            },
            "llama",
        )
        == 131072
    )
    assert (
        derive_max_model_len({"max_position_embeddings": 2048, "n_positions": 1024}, "gpt2") == 1024
    )
    assert (
        derive_max_model_len(
            {"max_position_embeddings": 8192, "model_max_length": 131072}, "cohere"
        )
        == 131072
    )
    assert derive_max_model_len({}, "llama") == 2048
    longrope = {
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]},
    }
    assert derive_max_model_len(longrope, "phi3") == 4096


def test_unknown_architecture_fails_closed_naming_it() -> None:
    with pytest.raises(UnsupportedArchitecture, match="RwkvForCausalLM"):
        spec_from_config(
            {"architectures": ["RwkvForCausalLM"], "model_type": "rwkv", "hidden_size": 1},
            name="x",
            source="t",
        )


def test_missing_fields_are_named() -> None:
    config = dict(QWEN3_NEXT)
    del config["linear_num_value_heads"], config["linear_key_head_dim"]
    with pytest.raises(
        UnsupportedArchitecture, match="linear_key_head_dim, linear_num_value_heads"
    ):
        spec_from_config(config, name="x", source="t")


def test_unknown_vision_tower_fails_closed() -> None:
    config = {
        "architectures": ["FooVLForConditionalGeneration"],
        "model_type": "foo_vl",
        "text_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
        },
        "vision_config": {"hidden_size": 32},
    }
    with pytest.raises(UnsupportedArchitecture, match="vision tower"):
        spec_from_config(config, name="x", source="t")


def test_wrong_type_is_malformed() -> None:
    config = dict(QWEN3_NEXT, hidden_size="big")
    with pytest.raises(MalformedConfig, match="wrong type.*'big'"):
        spec_from_config(config, name="x", source="t")


def test_sparse_gemma3_config_gets_transformers_defaults() -> None:
    """Hub Gemma 3 files list only non-default keys (gemma-3-4b-it names no head counts)."""
    from oomguard.facts.config_reader import CONFIG_DEFAULTS, apply_config_defaults

    sparse: dict[str, Any] = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 27,
            "patch_size": 14,
        },
    }
    spec = spec_from_config(sparse, name="g3-4b", source="t")
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_size) == (8, 4, 256)
    assert spec.vocab_size == 262208 and spec.derived_max_model_len == 131072
    assert [ly.kind for ly in spec.layers].count(AttentionKind.FULL) == 34 // 6
    assert spec.vision is not None and spec.vision.max_tokens_per_item == 256
    assert "configuration_gemma3.py" in CONFIG_DEFAULTS["gemma3_text"].source

    # the text_config of a gemma3 wrapper is a Gemma3TextConfig even without its model_type
    no_type = {
        **sparse,
        "text_config": {k: v for k, v in sparse["text_config"].items() if k != "model_type"},
    }
    assert apply_config_defaults(no_type)["text_config"]["num_attention_heads"] == 8
    # explicit values and explicit nulls win over the defaults
    explicit = {"model_type": "gemma3_text", "num_attention_heads": 4, "sliding_window": None}
    filled = apply_config_defaults(explicit)
    assert filled["num_attention_heads"] == 4 and filled["sliding_window"] is None
    assert filled["head_dim"] == 256
    # a SigLIP vision config missing its sizes gets SiglipVisionConfig's (224 px, patch 16)
    bare = apply_config_defaults({**sparse, "vision_config": {"model_type": "siglip_vision_model"}})
    assert (bare["vision_config"]["image_size"], bare["vision_config"]["patch_size"]) == (224, 16)
    # model types without a defaults entry pass through untouched
    assert apply_config_defaults({"model_type": "llama", "a": 1}) == {"model_type": "llama", "a": 1}


def test_gemma_4_audio_tower_counted_like_transformers() -> None:
    """E2B/E4B carry a conformer audio tower: 12 layers of hidden 1024 give 304,824,608
    parameters and the projection into a 2,560-wide text model 3,932,160 (transformers 5.19
    Gemma4AudioModel and embed_audio built from the same config)."""
    from oomguard.facts.catalogue import find_entry

    base = json.loads(json.dumps(find_entry("google/gemma-4-31B-it").config))
    base.pop("audio_config", None)
    audio = {
        "model_type": "gemma4_audio",
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "conv_kernel_size": 5,
        "subsampling_conv_channels": [128, 32],
        "output_proj_dims": 1536,
    }
    without = spec_from_config(base, name="g4", source="test")
    with_audio = spec_from_config({**base, "audio_config": audio}, name="g4", source="test")
    text_hidden = base["text_config"]["hidden_size"]
    assert with_audio.total_params - without.total_params == 304_824_608 + 1536 * text_hidden
