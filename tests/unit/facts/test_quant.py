"""Quantization format detection from quantization_config and from repo names."""

from __future__ import annotations

import pytest

from oomguard.errors import BadInput, UnsupportedArchitecture
from oomguard.facts.quant import (
    apply_quantization_flag,
    detect_quant,
    quant_from_config,
    quant_from_name,
    strip_quant_suffix,
)
from oomguard.memory.spec import QuantSpec


def test_awq_config() -> None:
    q = quant_from_config(
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    )
    assert (q.method, q.weight_bits, q.group_size, q.zero_point) == ("awq", 4, 128, True)
    assert {"embed", "lm_head", "router"} <= set(q.unquantized_groups)


def test_gptq_config_with_desc_act_and_channelwise() -> None:
    q = quant_from_config(
        {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True, "sym": True}
    )
    assert (q.method, q.weight_bits, q.group_size, q.desc_act, q.scale_granularity) == (
        "gptq",
        8,
        None,
        True,
        "channel",
    )


def test_fp8_block_and_per_tensor() -> None:
    block = quant_from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    )
    assert (block.method, block.scale_granularity, block.group_size) == ("fp8", "block", 128)
    tensor = quant_from_config({"quant_method": "fp8", "activation_scheme": "static"})
    assert (tensor.weight_bits, tensor.scale_granularity) == (8, "tensor")


def _ct(weights: dict[str, object], fmt: str, ignore: list[str] | None = None) -> dict[str, object]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ignore or ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def test_compressed_tensors_w4a16_w8a8_fp8_nvfp4() -> None:
    w4 = quant_from_config(
        _ct(
            {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 128,
                "symmetric": True,
            },
            "pack-quantized",
        )
    )
    assert (w4.method, w4.weight_bits, w4.group_size, w4.scale_granularity, w4.zero_point) == (
        "compressed-tensors",
        4,
        128,
        "group",
        False,
    )
    w8 = quant_from_config(
        _ct(
            {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
            "int-quantized",
        )
    )
    assert (w8.weight_bits, w8.scale_granularity) == (8, "channel")
    fp8 = quant_from_config(
        _ct({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized")
    )
    assert (fp8.method, fp8.scale_granularity) == ("fp8", "channel")
    nv = quant_from_config(
        _ct(
            {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
            "nvfp4-pack-quantized",
            ["lm_head", "re:.*mlp.gate$", "re:visual.*"],
        )
    )
    assert (nv.method, nv.weight_bits, nv.group_size) == ("nvfp4", 4, 16)
    assert {"lm_head", "router", "vision"} <= set(nv.unquantized_groups)


def test_bitsandbytes_4_and_8_bit() -> None:
    q4 = quant_from_config(
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    )
    assert (q4.method, q4.weight_bits, q4.group_size) == ("bitsandbytes", 4, 64)
    q8 = quant_from_config({"quant_method": "bitsandbytes", "load_in_8bit": True})
    assert q8.weight_bits == 8


def test_mxfp4_leaves_everything_but_experts_in_bf16() -> None:
    q = quant_from_config({"quant_method": "mxfp4"})
    assert q.method == "mxfp4" and q.group_size == 32
    assert "experts" not in q.unquantized_groups
    assert {"attn_qo", "attn_kv", "embed", "lm_head", "router"} <= set(q.unquantized_groups)


def test_modelopt_fp8_and_nvfp4() -> None:
    assert quant_from_config({"quant_method": "modelopt", "quant_algo": "FP8"}).method == "fp8"
    nv = quant_from_config(
        {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    )
    assert (nv.method, nv.group_size) == ("nvfp4", 16)


def test_unmodelled_method_fails_closed() -> None:
    with pytest.raises(UnsupportedArchitecture, match="hqq"):
        quant_from_config({"quant_method": "hqq"})


@pytest.mark.parametrize(
    ("name", "method", "bits", "granularity"),
    [
        ("Qwen/Qwen2.5-7B-Instruct-AWQ", "awq", 4, "group"),
        ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "gptq", 4, "group"),
        ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "gptq", 8, "group"),
        ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8", "fp8", 8, "tensor"),
        ("RedHatAI/Llama-3.1-8B-Instruct-FP8-dynamic", "fp8", 8, "channel"),
        ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "compressed-tensors", 4, "group"),
        ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "compressed-tensors", 8, "channel"),
        ("unsloth/llama-3-8b-Instruct-bnb-4bit", "bitsandbytes", 4, "group"),
        ("nvidia/Llama-3.3-70B-Instruct-NVFP4", "nvfp4", 4, "group"),
    ],
)
def test_quant_from_repo_name(name: str, method: str, bits: int, granularity: str) -> None:
    q = quant_from_name(name)
    assert q is not None and (q.method, q.weight_bits, q.scale_granularity) == (
        method,
        bits,
        granularity,
    )


def test_plain_names_are_not_quantized() -> None:
    for name in (
        "meta-llama/Llama-3.1-8B-Instruct",
        "Qwen/Qwen3-30B-A3B",
        "awqward/model-7b",
        "openai/gpt-oss-20b",
    ):
        assert quant_from_name(name) is None, name


def test_strip_suffix_finds_base_name() -> None:
    assert strip_quant_suffix("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4") == "Qwen/Qwen2.5-7B-Instruct"
    assert (
        strip_quant_suffix("RedHatAI/Llama-3.1-8B-Instruct-FP8-dynamic")
        == "RedHatAI/Llama-3.1-8B-Instruct"
    )
    assert (
        strip_quant_suffix("x/Meta-Llama-3.1-8B-Instruct-quantized.w4a16")
        == "x/Meta-Llama-3.1-8B-Instruct"
    )


def test_config_wins_over_name_and_text_config_is_searched() -> None:
    config = {
        "text_config": {
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}
        }
    }
    assert detect_quant(config, "x/Model-AWQ").method == "fp8"
    assert detect_quant({}, "x/Model-AWQ").method == "awq"
    assert detect_quant({}, "x/Model").method is None


def test_quantization_flag_rules() -> None:
    awq = quant_from_config({"quant_method": "awq", "bits": 4, "group_size": 128})
    assert apply_quantization_flag(awq, "awq_marlin") == awq
    assert apply_quantization_flag(QuantSpec(), "fp8").method == "fp8"  # online fp8
    with pytest.raises(BadInput, match="does not match"):
        apply_quantization_flag(awq, "gptq")
    with pytest.raises(BadInput, match="unquantized"):
        apply_quantization_flag(QuantSpec(), "awq")


def test_ignored_norms_are_norms_not_attention() -> None:
    """``post_attention_layernorm`` in modules_to_not_convert is a norm: the attention
    projections of the checkpoint stay fp8 (Qwen3-MoE FP8 lists every layer's norms)."""
    q = quant_from_config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [
                "lm_head",
                "model.layers.0.input_layernorm",
                "model.layers.0.mlp.gate",
                "model.layers.0.post_attention_layernorm",
            ],
        }
    )
    assert "attn_qo" not in q.unquantized_groups and "attn_kv" not in q.unquantized_groups
    assert {"norm", "router", "lm_head"} <= set(q.unquantized_groups)


def test_ignored_attention_modules_stay_in_model_dtype() -> None:
    q = quant_from_config(
        {"quant_method": "fp8", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    )
    assert {"attn_qo", "attn_kv"} <= set(q.unquantized_groups)


def test_qwen3_moe_fp8_weights_price_attention_at_one_byte() -> None:
    """Qwen3-30B-A3B-FP8 loads in about 29.1 GiB; pricing its attention at bf16 gave 29.89."""
    from oomguard.facts.resolve import resolve_model
    from oomguard.memory.weights import weight_bytes_per_stage

    spec = resolve_model("Qwen/Qwen3-30B-A3B-FP8", allow_hub=False)
    gib = weight_bytes_per_stage(spec, model_dtype="bfloat16").max_bytes / 2**30
    assert 28.9 < gib < 29.3
