"""Offline answers for the models people deploy: catalogue entries, aliases (re-releases with
their own positions), quantized names, sibling releases, and the generic reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.errors import UnknownModel, UnsupportedArchitecture
from oomguard.facts.catalogue import find_entry, list_aliases, lookup_entry
from oomguard.facts.config_reader import spec_from_config
from oomguard.facts.resolve import resolve_model, sibling_names
from oomguard.memory.bands import SHIPPED_BANDS
from oomguard.memory.engine import UNVERIFIED_WEIGHTS_BAND
from oomguard.plan import service as api

# every model the 2026 startup logs named that the planner refused before (architectures,
# re-releases, siblings and quantized variants), with what it must resolve to offline
NAMED = {
    "google/gemma-4-26B-A4B-it": "gemma4",
    "google/gemma-4-31B-it": "gemma4",
    "google/gemma-3n-E4B-it": "gemma3n",
    "Qwen/Qwen3.5-27B": "qwen3_5",
    "Qwen/Qwen3.5-35B-A3B": "qwen3_5_moe",
    "Qwen/Qwen3.5-122B-A10B": "qwen3_5_moe",
    "Qwen/Qwen3.5-397B-A17B": "qwen3_5_moe",
    "Qwen/Qwen3.6-35B-A3B": "qwen3_5_moe",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_moe",
    "Qwen/Qwen3-VL-235B-A22B-Instruct": "qwen3_vl_moe",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl",
    "llava-hf/llava-v1.6-mistral-7b-hf": "llava_next",
    "LGAI-EXAONE/EXAONE-4.0-32B": "exaone4",
    "LGAI-EXAONE/EXAONE-4.0-1.2B": "exaone4",
    "zai-org/GLM-4.5": "glm4_moe",
    "zai-org/GLM-4.5-Air": "glm4_moe",
    "zai-org/GLM-4.6": "glm4_moe",
    "zai-org/GLM-4.5-Air-FP8": "glm4_moe",
    "deepseek-ai/DeepSeek-V3.2": "deepseek_v32",
    "deepseek-ai/DeepSeek-V3.2-Exp": "deepseek_v32",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3_moe",
    "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8": "qwen3_moe",
    "Qwen/Qwen3-4B-Instruct-2507": "qwen3",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "qwen3_moe",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8": "qwen3_moe",
    "ibm-granite/granite-4.0-micro": "granitemoehybrid",
    "Qwen/Qwen3-8B-Base": "qwen3",
    "Qwen/Qwen2.5-14B-Instruct": "qwen2",
    "meta-llama/Llama-3.1-8B-Instruct-AWQ": "llama",
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_model_resolves_offline(name: str) -> None:
    spec = resolve_model(name, allow_hub=False)
    assert spec.model_type == NAMED[name]
    assert spec.verified and spec.total_params > 0 and spec.layers


def test_re_release_keeps_its_own_positions_and_quantization() -> None:
    base = resolve_model("Qwen/Qwen3-30B-A3B", allow_hub=False)
    alias = resolve_model("Qwen/Qwen3-30B-A3B-Instruct-2507", allow_hub=False)
    assert (base.derived_max_model_len, alias.derived_max_model_len) == (40960, 262144)
    assert alias.total_params == base.total_params and alias.name.endswith("-2507")
    assert "alias of catalogue Qwen/Qwen3-30B-A3B" in alias.source
    fp8 = resolve_model("Qwen/Qwen3-30B-A3B-Instruct-2507-FP8", allow_hub=False)
    assert fp8.quant.method == "fp8" and fp8.derived_max_model_len == 262144
    assert any("fp8 weight format its name states" in c for c in fp8.caveats)


def test_every_alias_names_a_catalogued_base_and_its_source() -> None:
    aliases = list_aliases()
    assert len(aliases) >= 7
    for alias in aliases:
        assert find_entry(alias.base).id == alias.base, alias.id
        assert alias.source and alias.overrides, alias.id
        assert lookup_entry(alias.id) is None, f"{alias.id} is both an entry and an alias"


def test_sibling_release_stands_in_with_a_visible_caveat() -> None:
    assert "Qwen/Qwen3-8B" in sibling_names("Qwen/Qwen3-8B-Base")
    assert "google/gemma-3-12b-it" in sibling_names("google/gemma-3-12b-pt")
    spec = resolve_model("google/gemma-3-12b-pt", allow_hub=False)
    assert spec.name == "google/gemma-3-12b-pt" and spec.model_type == "gemma3"
    assert any("sibling release google/gemma-3-12b-it" in c for c in spec.caveats)
    result = api.plan("google/gemma-3-12b-pt", "H100", allow_hub=False, use_calibration=False)
    assert any("sibling release" in n for n in result.notes)
    with pytest.raises(UnknownModel):
        resolve_model("someone/entirely-unknown-model-7b-it", allow_hub=False)


FANCY = {
    "architectures": ["FancyNewForCausalLM"], "model_type": "fancy_new", "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 32000,
    "max_position_embeddings": 16384, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 4, "sliding_window": 1024,
    "some_new_multiplier": 2.0,
}  # fmt: skip


def test_generic_reader_plans_a_standard_decoder_as_not_verified(tmp_path: Path) -> None:
    spec = spec_from_config(FANCY, name="fancy", source="test")
    per_layer = 2 * 2048 * 16 * 128 + 2 * 2048 * 4 * 128 + 3 * 2048 * 5632 + 2 * 2048
    assert spec.total_params == 8 * per_layer + 2048 + 2 * 32000 * 2048
    assert not spec.verified and "architecture not verified" in spec.caveats[0]
    assert "some_new_multiplier" in spec.caveats[0]
    assert [ly.sliding_window for ly in spec.layers[:2]] == [1024, None]
    d = tmp_path / "fancy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(FANCY))
    result = api.plan(str(d), "H100", allow_hub=False, use_calibration=False)
    out = result.to_dict()
    assert out["model_verified"] is False
    assert any("architecture not verified" in n for n in out["notes"])
    w, value = out["estimates"]["weights"], out["memory"]["weights_gib"]
    assert w["estimated"]
    # at least UNVERIFIED_WEIGHTS_BAND, else the dense band of out-of-sample weights errors
    half = max(SHIPPED_BANDS.weights["dense"].half_width, UNVERIFIED_WEIGHTS_BAND)
    assert w["low_gib"] == pytest.approx((1 - half) * value, abs=0.011)
    assert w["high_gib"] == pytest.approx((1 + half) * value, abs=0.011)
    # the same shape under a reader of its own (Llama with QK layer types) has a range no wider
    # (narrower where the floor for an unverified architecture exceeds the dense band)
    twin = tmp_path / "twin"
    twin.mkdir()
    known = {
        **FANCY,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "some_new_multiplier": None,
    }
    (twin / "config.json").write_text(json.dumps(known))
    verified = api.plan(str(twin), "H100", allow_hub=False, use_calibration=False).to_dict()
    assert verified["model_verified"] is True
    low, high = out["memory"]["kv_cache_gib_range"]
    vlow, vhigh = verified["memory"]["kv_cache_gib_range"]
    if UNVERIFIED_WEIGHTS_BAND > SHIPPED_BANDS.weights["dense"].half_width:
        assert high - low > vhigh - vlow
    else:
        assert high - low == pytest.approx(vhigh - vlow, abs=0.02)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kv_lora_rank": 512}, "kv_lora_rank"),
        ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
        ({"mamba_d_state": 128}, "mamba_d_state"),
        ({"layer_types": ["linear_attention", "full_attention"] * 4}, "linear_attention"),
        ({"vision_config": {"hidden_size": 1024}}, "vision_config"),
    ],
)
def test_generic_reader_fails_closed_on_cache_fields_it_does_not_know(
    extra: dict[str, object], named: str
) -> None:
    with pytest.raises(UnsupportedArchitecture, match=named):
        spec_from_config({**FANCY, **extra}, name="fancy", source="test")


def test_sliding_window_without_layer_types_is_refused_generically() -> None:
    cfg = {k: v for k, v in FANCY.items() if k != "layer_types"}
    with pytest.raises(UnsupportedArchitecture, match="which layers slide"):
        spec_from_config(cfg, name="fancy", source="test")


def test_deepseek_v4_is_refused_naming_what_is_not_modelled() -> None:
    cfg = {
        **FANCY,
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "compress_ratios": [0, 4, 128] * 2 + [0, 4],
    }
    with pytest.raises(UnsupportedArchitecture, match="compressed sparse attention"):
        spec_from_config(cfg, name="deepseek-ai/DeepSeek-V4-Flash", source="test")
