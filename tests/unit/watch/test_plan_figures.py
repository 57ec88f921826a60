"""Plan figures from a plan file, from --model flags, and the bad plan files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.errors import BadInput
from oomguard.plan.service import plan
from oomguard.watch.plan_figures import load_plan_file, plan_from_flags

GIB = 2**30


def test_a_plan_file_written_by_oomguard_plan(tmp_path: Path) -> None:
    result = plan("Qwen/Qwen3-8B", "L40S", allow_hub=False, gpu_memory_utilization=0.9)
    path = tmp_path / "plan.json"
    path.write_text(result.to_json())
    figures = load_plan_file(path)
    p = result.plan.prediction
    assert figures.kv_cache_tokens == p.kv_cache_tokens
    assert figures.requested_bytes == pytest.approx(p.requested_bytes, abs=0.006 * GIB)
    assert figures.gpu_memory_utilization == 0.9 and figures.gpu_count == 1


def test_model_flags_plan_the_same_as_the_plan_command() -> None:
    figures = plan_from_flags(
        ["Qwen/Qwen3-8B", "--gpu", "L40S", "--gpu-memory-utilization", "0.9", "--offline"]
    )
    direct = plan("Qwen/Qwen3-8B", "L40S", allow_hub=False, gpu_memory_utilization=0.9)
    assert figures.kv_cache_tokens == direct.plan.prediction.kv_cache_tokens


def test_bad_plan_flags_are_one_line() -> None:
    with pytest.raises(BadInput, match="--gpu-memory-utilization"):
        plan_from_flags(
            ["Qwen/Qwen3-8B", "--gpu", "L40S", "--gpu-memory-utilization", "1.5", "--offline"]
        )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"memory": {}}', "has no gpu.count"),
        ('{"gpu": {"count": 1}, "memory": {"total_gib": "x"}}', "not a number"),
    ],
)
def test_plan_files_that_do_not_parse(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(BadInput, match=match) as info:
        load_plan_file(path)
    assert "\n" not in info.value.one_line() and "oomguard plan" in info.value.one_line()


def test_a_missing_plan_file(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="cannot read plan file"):
        load_plan_file(tmp_path / "nope.json")


def test_plan_json_keys_the_watcher_reads_exist() -> None:
    data = json.loads(plan("Qwen/Qwen3-8B", "L40S", allow_hub=False).to_json())
    assert {"total_gib", "requested_gib", "weights_gib", "kv_cache_gib"} <= set(data["memory"])
    assert "kv_cache_tokens" in data and "count" in data["gpu"]
