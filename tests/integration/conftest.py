"""Fixtures for the integration tier: real vLLM on CPU serving a tiny generated model.

Tests marked ``integration`` that need vLLM take the ``vllm_venv_path`` fixture, which skips
them with the reason when the venv is missing (create it with ``scripts/setup-vllm-cpu.sh``;
path from ``$OOMGUARD_VLLM_VENV``, default ``<repo>/.venv-vllm``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from tinymodel import TinyModel, create_tiny_model  # noqa: E402
from vllm_server import VllmServer, vllm_venv, vllm_venv_problem  # noqa: E402

DATA_DIR = HERE / "data"


def require_or_skip(problem: str | None) -> None:
    """Skip the test for a missing component, or fail it where everything must be installed.

    ``scripts/test-all.sh`` installs every component and sets ``OOMGUARD_REQUIRE_ALL=1``, so in
    CI a missing component is an error, never a silent skip.
    """
    if not problem:
        return
    if os.environ.get("OOMGUARD_REQUIRE_ALL") == "1":
        pytest.fail(f"{problem} (OOMGUARD_REQUIRE_ALL=1: every component must be installed)")
    pytest.skip(problem)


def require_program(name: str, package: str) -> str:
    """The path of system program ``name``; skips (or fails, see above) when it is missing."""
    path = shutil.which(name)
    require_or_skip(
        None if path else f"{name} not found (scripts/setup-system.sh installs {package})"
    )
    assert path is not None
    return path


@pytest.fixture(scope="session")
def vllm_venv_path() -> Path:
    """The vLLM CPU venv; skips the test when it is not there."""
    require_or_skip(vllm_venv_problem())
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


# --- one vLLM server shared by the tests that only send it traffic ------------------------

SHARED_POOL_BLOCKS = 16  # 16 blocks x 128 tokens = 2,048 tokens of KV
SHARED_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def shared_vllm(
    vllm_venv_path: Path, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One real vLLM server for the whole run: the tiny model, a pool of 2,048 tokens
    (16 blocks of 128), ``--max-model-len 1024``, vLLM's default ``--max-num-seqs`` (128 on
    CPU), so a burst of long requests really preempts.

    Tests that only send traffic and read ``/metrics`` share it instead of starting their
    own (each start costs 20-40 s on 2 cores). A test must leave it idle: wait for its own
    requests to end (``wait_vllm_idle``). A test that needs other flags, a crash or a restart
    starts its own server.
    """
    from scenarios import BLOCK_BYTES
    from vllm_server import ServeConfig, VllmServer

    log_path = tmp_path_factory.mktemp("shared-vllm") / "vllm.log"
    config = ServeConfig(
        model_dir=tiny_model.path,
        kv_cache_memory_bytes=SHARED_POOL_BLOCKS * BLOCK_BYTES,
        max_model_len=SHARED_MAX_MODEL_LEN,
    )
    server = VllmServer(config, log_path, vllm_venv_path)
    server.start()
    try:
        server.wait_healthy(timeout_s=600)
        yield server
    finally:
        server.stop()


def wait_vllm_idle(base_url: str, timeout_s: float = 120.0) -> None:
    """Wait until the server runs and queues no request (read from its ``/metrics``)."""
    from vllm_server import fetch_metrics, metric_value

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = fetch_metrics(base_url)
        if (
            metric_value(text, "vllm:num_requests_running") == 0
            and metric_value(text, "vllm:num_requests_waiting") == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"vLLM at {base_url} still busy after {timeout_s:.0f} s")
