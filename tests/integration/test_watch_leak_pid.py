"""``oomguard watch --pid`` on real processes: one that grows its memory on purpose is flagged
as a leak, with the time until memory runs out; one that holds a flat size with the same
transient noise is not. The windows are shortened (seconds instead of minutes) so the test
runs in half a minute; the default settings are checked on recorded traces in the unit tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.engine import kill_group, start_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

GROW = Path(__file__).parent / "grow_memory.py"


def _grower(rate_mib_per_min: float) -> subprocess.Popen[str]:
    proc = start_group(
        [
            sys.executable,
            str(GROW),
            "--rate-mib-per-min",
            str(rate_mib_per_min),
            "--duration-s",
            "120",
            "--transient-mib",
            "8",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_growing_process_is_a_leak_and_a_flat_one_is_not(oomguard_exe: list[str]) -> None:
    growing, flat = _grower(400), _grower(0)
    try:
        run = subprocess.run(
            [
                *oomguard_exe,
                "watch",
                "--pid",
                str(growing.pid),
                "--pid",
                str(flat.pid),
                "--json",
                "--interval",
                "0.25",
                "--duration",
                "24",
                "--leak-window",
                "12",
                "--leak-settle",
                "2",
                "--leak-rate",
                "100",
                "--min-duration",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for p in (growing, flat):
            kill_group(p.pid, leader=p)
    events = [json.loads(line) for line in run.stdout.splitlines()]
    leaks = [e for e in events if e.get("alert") == "OomguardMemoryLeak"]
    assert [(e["server"], e["state"]) for e in leaks] == [(f"pid:{growing.pid}", "firing")], (
        run.stdout + run.stderr
    )
    leak = leaks[0]
    assert leak["labels"] == {"memory": "host"}
    assert 200 <= leak["value"] * 60 / 2**20 <= 700  # MiB/min, the process grows ~400
    assert "exhausted in" in leak["message"]
    assert run.returncode == 1  # the leak still fires when the watch ends
