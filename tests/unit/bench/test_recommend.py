"""Recommendations: --max-num-seqs, the guard's watermarks, the vllm serve line."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from oomguard.bench.recommend import recommend, watermarks
from oomguard.bench.server import Capacity

POOL = Capacity(
    usable_blocks=15,
    block_size=128,
    kv_cache_tokens=2048,
    kv_cache_memory_bytes=1_048_576,
    num_gpu_blocks=16,
    gpu_memory_utilization=0.92,
)


def admits(high: float, blocks: int, usable: int) -> int:
    """Requests of ``blocks`` the guard admits under ``high`` (reservations <= high x pool)."""
    return int(math.floor(high * usable + 1e-9) // blocks)


def test_watermarks_admit_exactly_the_safe_number() -> None:
    high, low, notes = watermarks(7, 2, 15, 0.95)
    assert (high, low, notes) == (0.934, 0.8, [])
    assert admits(high, 2, 15) == 7


@given(st.integers(1, 64), st.integers(1, 40), st.integers(2, 4000))
def test_watermarks_never_admit_one_more(safe: int, blocks: int, usable: int) -> None:
    if safe * blocks > usable:
        return
    high, low, _ = watermarks(safe, blocks, usable, 1.0)
    assert 0 < low < high <= 1.0
    assert admits(high, blocks, usable) == safe


def test_recommendation_from_a_measured_safe_point() -> None:
    rec = recommend(
        max_safe=7,
        proven_running=7,
        capacity=POOL,
        peak_sequence_tokens=256,
        kv_peak_at_safe=14 / 15,
        kv_limit=0.95,
        model="m",
        max_model_len=1024,
        backend_url="http://h:1",
    )
    assert rec.max_num_seqs == 7 and rec.high_watermark == 0.934
    assert rec.kv_bytes_per_token == 512.0 and rec.blocks_per_request == 2
    assert rec.kv_tokens_per_request_measured == 256.0
    assert rec.vllm_command == (
        "vllm serve m --max-num-seqs 7 --max-model-len 1024 --kv-cache-memory-bytes 1048576"
    )
    assert rec.guard_config == {
        "backends": [
            {"url": "http://h:1", "num_gpu_blocks": 16, "block_size": 128, "max_model_len": 1024}
        ],
        "high_watermark": 0.934,
        "low_watermark": 0.8,
    }


def test_only_what_the_server_ran_is_proven() -> None:
    rec = recommend(
        max_safe=16,
        proven_running=6,
        capacity=POOL,
        peak_sequence_tokens=256,
        kv_peak_at_safe=0.8,
        kv_limit=0.95,
        model="m",
        max_model_len=None,
        backend_url="http://h:1",
    )
    assert rec.max_num_seqs == 6 and "never ran more than 6" in rec.notes[0]


def test_nothing_safe_recommends_nothing() -> None:
    rec = recommend(
        max_safe=None,
        proven_running=None,
        capacity=POOL,
        peak_sequence_tokens=9000,
        kv_peak_at_safe=None,
        kv_limit=0.95,
        model="m",
        max_model_len=None,
        backend_url="http://h:1",
    )
    assert rec.max_num_seqs is None and rec.vllm_command is None and rec.guard_config is None


def test_without_a_stated_pool_the_command_keeps_the_utilization() -> None:
    pool = Capacity(
        usable_blocks=1000, block_size=16, num_gpu_blocks=1001, gpu_memory_utilization=0.9
    )
    rec = recommend(
        max_safe=12,
        proven_running=None,
        capacity=pool,
        peak_sequence_tokens=1200,
        kv_peak_at_safe=None,
        kv_limit=0.95,
        model="org/x",
        max_model_len=4096,
        backend_url="http://h:1",
    )
    assert (
        rec.vllm_command
        == "vllm serve org/x --max-num-seqs 12 --max-model-len 4096 --gpu-memory-utilization 0.9"
    )
    assert rec.kv_bytes_per_token is None and "not stated" in rec.kv_bytes_per_token_source


def test_through_a_gateway_the_cap_comes_from_the_pool() -> None:
    rec = recommend(
        max_safe=16,
        proven_running=8,
        capacity=POOL,
        peak_sequence_tokens=256,
        kv_peak_at_safe=0.93,
        kv_limit=0.95,
        model="m",
        max_model_len=1024,
        backend_url="http://guard:1",
        gateway=True,
    )
    assert rec.max_num_seqs == 7 and "through a gateway" in rec.notes[0]
