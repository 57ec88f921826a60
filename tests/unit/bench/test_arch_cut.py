"""Cutting a real config to a few layers for the per-architecture table (tests/integration)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))

from arch_cut import cut_config, target_layers, text_part  # noqa: E402

from oomguard.facts.catalogue import find_entry  # noqa: E402
from oomguard.facts.config_reader import spec_from_config  # noqa: E402


def _params(config: dict[str, Any]) -> int:
    return spec_from_config(config, name="cut", source="test").total_params


def test_dense_model_keeps_widths_and_cuts_layers() -> None:
    config = find_entry("Qwen/Qwen3-0.6B").config
    cut = cut_config(config, _params)
    assert cut.config["num_hidden_layers"] == 2
    assert cut.config["hidden_size"] == config["hidden_size"]
    assert cut.config["head_dim"] == config["head_dim"]
    assert cut.notes == ("layers 28→2",)
    assert config["num_hidden_layers"] == 28  # the input is not changed


def test_sliding_window_pattern_keeps_a_full_layer() -> None:
    config = find_entry("google/gemma-3-1b-it").config
    cut = cut_config(config, _params)
    # five sliding layers, then the first full one
    assert cut.config["num_hidden_layers"] == 6
    assert cut.notes[0] == "layers 26→6"


def test_layer_types_keep_every_kind_of_layer() -> None:
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    config = {"num_hidden_layers": 12, "layer_types": kinds * 3, "mlp_only_layers": [0, 9]}
    cut = cut_config(config, lambda _cfg: 0)
    assert cut.config["num_hidden_layers"] == 4
    assert cut.config["layer_types"] == kinds
    assert cut.config["mlp_only_layers"] == [0]


def test_hybrid_pattern_string_is_truncated_with_the_layers() -> None:
    config = find_entry("nvidia/Nemotron-H-56B-Base-8K").config
    cut = cut_config(config, _params)
    n = cut.config["num_hidden_layers"]
    assert len(cut.config["hybrid_override_pattern"]) == n
    assert set(cut.config["hybrid_override_pattern"]) == set(config["hybrid_override_pattern"])


def test_jamba_periods_decide_the_layer_count() -> None:
    cfg = {
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_hidden_layers": 32,
    }
    assert target_layers(cfg) == 8


def test_moe_experts_and_groups_are_cut_and_recorded() -> None:
    config = find_entry("deepseek-ai/DeepSeek-V3").config
    cut = cut_config(config, _params)
    cfg = cut.config
    assert cfg["n_routed_experts"] == 8
    assert cfg["num_experts_per_tok"] <= 8
    assert cfg["n_group"] == cfg["topk_group"] == 1
    assert cfg["first_k_dense_replace"] == 1
    assert "n_routed_experts 256→8" in cut.notes
    assert "quantization_config" not in cfg and "quantization dropped" in cut.notes


def test_weights_fit_the_budget_and_head_size_is_kept() -> None:
    config = find_entry("meta-llama/Llama-3.1-8B").config
    budget = 1 << 30
    cut = cut_config(config, _params, budget_bytes=budget)
    assert _params(cut.config) * 4 <= budget
    head = config["hidden_size"] // config["num_attention_heads"]
    cfg = cut.config
    assert cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) == head
    assert any(n.startswith("vocab_size") for n in cut.notes)


def test_multimodal_cuts_the_text_config_and_the_vision_tower() -> None:
    config = find_entry("Qwen/Qwen3-VL-2B-Instruct").config
    cut = cut_config(config, _params)
    assert text_part(cut.config)["num_hidden_layers"] == 2
    assert cut.config["vision_config"]["depth"] == 2
    assert "vision depth 24→2" in cut.notes
    assert cut.describe().startswith("layers 28→2")
