"""The bench face's CLI: registered, light to load, bad flags answered in one line."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from oomguard.cli import main
code = main(sys.argv[1:])
heavy = [m for m in ("oomguard.guard.app", "oomguard.doctor.rules", "matplotlib") \
if m in sys.modules]
print("LOADED=" + ",".join(heavy), "CODE=" + str(code), file=sys.stderr)
"""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )


def test_help_loads_no_other_face_and_no_plotting() -> None:
    out = run("bench", "--help")
    assert "--prompt-tokens" in out.stdout and "--budget-s" in out.stdout
    assert "LOADED= CODE=0" in out.stderr


def test_bad_input_exits_2_with_one_line() -> None:
    out = run(
        "bench",
        "http://127.0.0.1:9",
        "--prompt-tokens",
        "5",
        "--max-tokens",
        "5",
        "--sample-interval-s",
        "2",
    )
    assert "CODE=2" in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--sample-interval-s" in errors[0]
