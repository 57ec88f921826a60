"""The per-architecture table's comparison of planner and vLLM figures (bench/arch_table.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import arch_table  # noqa: E402


def _vllm(groups: list[dict[str, Any]], block_size: int = 128) -> dict[str, Any]:
    return {
        "params_bytes": 1000,
        "buffers_bytes": 0,
        "kv_groups": groups,
        "num_blocks": 10,
        "block_size": block_size,
        "kv_cache_tokens": 1280,
        "max_concurrency": "2.50",
    }


def _planner(**over: Any) -> dict[str, Any]:
    base = {
        "weights_bytes": 1005,
        "bytes_per_block": 2048,
        "kv_bytes_per_token": 16,
        "num_blocks": 10,
        "block_size": 128,
        "kv_cache_tokens": 1280,
        "max_concurrency": "2.50",
    }
    return {**base, **over}


def test_one_group_counts_every_layer() -> None:
    vllm = _vllm([{"page": 1024, "layers": 2, "attention": True}])
    assert arch_table.vllm_kv_figures(vllm) == (2048, 16)
    assert arch_table.compare(_planner(), vllm) == []


def test_hybrid_model_counts_only_attention_per_token() -> None:
    groups = [{"page": 4096, "layers": 1, "attention": False}] * 3
    groups += [{"page": 4096, "layers": 1, "attention": True}]
    assert arch_table.vllm_kv_figures(_vllm(groups, block_size=256)) == (4096, 16)


def test_differences_are_named() -> None:
    vllm = _vllm([{"page": 1024, "layers": 2, "attention": True}])
    diffs = arch_table.compare(_planner(weights_bytes=1100, num_blocks=11), vllm)
    assert len(diffs) == 2
    assert diffs[0].startswith("weights 1,100 vs 1,000 B (+10.0%")
    assert diffs[1] == "blocks 11 vs 10"
