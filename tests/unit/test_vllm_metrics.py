"""The /metrics snapshot read from a real page of vLLM 0.32.0 (CPU) after a burst."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.vllm_metrics import parse_vllm_metrics

PAGE = Path(__file__).parents[1] / "integration" / "data" / "metrics_vllm_0.32.0_after_burst.txt"


def test_real_page_after_a_burst() -> None:
    snap = parse_vllm_metrics(PAGE.read_text())
    assert snap.is_vllm and snap.engines == 1
    assert snap.kv_cache_usage == 0.0
    assert snap.preemptions_total == 1.0
    assert snap.requests_running == 0.0 and snap.requests_waiting == 0.0
    assert snap.waiting_by_reason == {"capacity": 0.0, "deferred": 0.0}
    assert snap.waiting_for_capacity == 0.0
    assert snap.prompt_tokens_total == 12 * 180 and snap.generation_tokens_total == 12 * 300
    assert snap.requests_succeeded_total == 12.0
    assert (snap.num_gpu_blocks, snap.block_size, snap.usable_blocks) == (16, 128, 15)
    assert snap.kv_cache_tokens == 2048  # vLLM's own statement: 16 blocks x 128
    assert snap.sleeping is False


def test_engines_are_summed_and_usage_is_the_fullest() -> None:
    page = "\n".join(
        [
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0',
            'vllm:num_preemptions_total{engine="1",model_name="m"} 3.0',
            'vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 4.0',
        ]
    )
    snap = parse_vllm_metrics(page)
    assert snap.engines == 2 and snap.kv_cache_usage == 0.75 and snap.preemptions_total == 5.0
    assert snap.waiting_for_capacity == 4.0


def test_a_page_that_is_not_vllm() -> None:
    snap = parse_vllm_metrics("# HELP up x\n# TYPE up gauge\nup 1\n")
    assert not snap.is_vllm and snap.kv_cache_usage is None and snap.waiting_for_capacity is None


def test_malformed_page_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0" 0.5\n')
