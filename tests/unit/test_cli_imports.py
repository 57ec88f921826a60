"""Each command imports only its own face: ``oomguard plan`` never loads the gateway."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from oomguard.cli import main
main(sys.argv[1:])
heavy = [m for m in ("aiohttp", "oomguard.guard.app", "oomguard.doctor.diagnose") if m in sys.modules]
print("LOADED=" + ",".join(heavy), file=sys.stderr)
"""


def _loaded(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )
    line = next(x for x in out.stderr.splitlines() if x.startswith("LOADED="))
    return [m for m in line.removeprefix("LOADED=").split(",") if m]


def test_plan_does_not_import_the_gateway_or_the_doctor() -> None:
    assert _loaded("plan", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4", "--json") == []


def test_help_lists_every_face() -> None:
    from typer.main import get_command

    from oomguard.cli import FACES, build_app

    names = set(get_command(build_app()).commands)  # type: ignore[attr-defined]
    assert set(FACES) <= names
