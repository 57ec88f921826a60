"""Each command imports only its own face: ``oomguard plan`` never loads the gateway, and a
face whose extra is not installed says so in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.errors import EXIT_ENVIRONMENT

PROBE = """
import sys
from oomguard.cli import main
main(sys.argv[1:])
heavy = [m for m in ("aiohttp", "oomguard.guard.app", "oomguard.doctor.diagnose") \
if m in sys.modules]
print("LOADED=" + ",".join(heavy), file=sys.stderr)
"""

# the libraries of the extras (guard, bench, watch): the core install has none of them
EXTRA_LIBRARIES = ("aiohttp", "redis", "uvloop", "matplotlib", "tokenizers", "prometheus_client")

# runs the CLI as if the named modules were not installed (None in sys.modules stops an import)
WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from oomguard.cli import main
raise SystemExit(main(sys.argv[2:]))
"""

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _loaded(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )
    line = next(x for x in out.stderr.splitlines() if x.startswith("LOADED="))
    return [m for m in line.removeprefix("LOADED=").split(",") if m]


def _without(modules: tuple[str, ...], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, ",".join(modules), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plan_does_not_import_the_gateway_or_the_doctor() -> None:
    assert _loaded("plan", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4", "--json") == []


def test_a_plan_that_falls_back_to_llama_cpp_loads_only_the_split() -> None:
    """The fallback chain prices llama.cpp's split; its load-log reader and check stay unloaded."""
    probe = PROBE.replace(
        '("aiohttp", "oomguard.guard.app", "oomguard.doctor.diagnose")',
        '("oomguard.tiering.loadlog", "oomguard.tiering.compare")',
    )
    argv = ["plan", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "RTX 4090", "--p99-tokens"]
    out = subprocess.run(
        [sys.executable, "-c", probe, *argv, "8192", "--concurrency", "16"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert "llama-server" in out.stdout, out.stderr[-500:]  # the chain ran
    assert "LOADED=\n" in out.stderr + "\n", out.stderr[-500:]


def test_plan_imports_no_library_of_an_extra() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "oomguard",
            "plan",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--gpu",
            "L4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr[-500:]
    # "import time: self [us] | cumulative | imported package", one line per module imported
    imported = {
        m.group(1).strip()
        for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", proc.stderr, re.M)
    }
    assert "oomguard.plan.recommend" in imported  # the probe reads what it should
    assert sorted(imported & set(EXTRA_LIBRARIES)) == []


@pytest.mark.parametrize(
    ("command", "missing"),
    [
        (["guard", "--backend", "http://127.0.0.1:9"], "aiohttp"),
        (["bench", "http://127.0.0.1:9", "--prompt-tokens", "10", "--max-tokens", "10"], "aiohttp"),
        (["watch", "http://127.0.0.1:9", "--once"], "prometheus_client"),
    ],
)
def test_a_missing_extra_names_the_install_in_one_line(command: list[str], missing: str) -> None:
    proc = _without((missing,), *command)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    face = command[0]
    assert proc.returncode == EXIT_ENVIRONMENT, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"oomguard {face} needs the {face} extra" in lines[0]
    assert f"pip install 'oomguard[{face}]'" in lines[0]


def test_help_and_plan_work_without_any_extra() -> None:
    assert _without(EXTRA_LIBRARIES, "--help").returncode == 0
    plan = _without(EXTRA_LIBRARIES, "plan", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4")
    assert plan.returncode in (0, 1) and "Traceback" not in plan.stderr, plan.stderr


def test_the_extras_table_matches_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    from oomguard.cli import EXTRA_MODULES, FACE_EXTRA

    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]

    def modules(extra: str) -> set[str]:
        names: set[str] = set()
        for requirement in extras[extra]:
            name = re.split(r"[<>=!;\[ ]", requirement, maxsplit=1)[0]
            if name == "oomguard":  # a self-reference: oomguard[guard]
                for inner in re.search(r"\[(.*)\]", requirement).group(1).split(","):  # type: ignore[union-attr]
                    names |= modules(inner.strip())
            else:
                names.add(name.replace("-", "_"))
        return names

    assert set(FACE_EXTRA.values()) <= set(extras)
    for extra, expected in EXTRA_MODULES.items():
        assert modules(extra) == set(expected), extra
    assert modules("all") == set().union(*EXTRA_MODULES.values())
    assert "oomguard[all]" in extras["test"]


def test_help_lists_every_face() -> None:
    from typer.main import get_command

    from oomguard.cli import FACES, build_app

    names = set(get_command(build_app()).commands)  # type: ignore[attr-defined]
    assert set(FACES) <= names
