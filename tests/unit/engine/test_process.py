"""EngineProcess on real process trees: output streamed as it comes, whole group stopped."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from oomguard.engine import (
    EngineLeftBehind,
    EngineProcess,
    EngineStartError,
    group_pids,
    kill_group,
    signal_group,
    start_group,
    stop_group,
    wait_memory_released,
)
from oomguard.errors import EXIT_ENGINE_FAILED

# A parent that starts two children (like vLLM's API server → engine core → worker), prints,
# and ignores SIGTERM in one child, so only SIGKILL ends it.
TREE = """
import os, signal, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]),
        subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); \
print('stubborn', flush=True); time.sleep(600)"])]
print("started", os.getpid(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
time.sleep(600)
"""


def _wait(cond, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_stop_ends_the_whole_group_even_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    lines: list[str] = []
    engine = EngineProcess(
        [sys.executable, "-c", TREE], log_path=tmp_path / "e.log", on_line=lines.append
    )
    engine.start()
    assert _wait(lambda: len(engine.group_pids()) == 3 and "stubborn" in lines)
    pids = engine.group_pids()
    engine.stop(grace_s=1.0)
    assert group_pids(engine.pid) == []
    assert engine.returncode is not None
    assert wait_memory_released(pids, timeout_s=5).released
    log = (tmp_path / "e.log").read_text()
    assert "started" in log and "to stderr" in log  # stderr merged, as a terminal shows it
    assert any(line.startswith("started") for line in lines)


def test_kill_is_immediate(tmp_path: Path) -> None:
    engine = EngineProcess([sys.executable, "-c", TREE])
    engine.start()
    assert _wait(lambda: len(engine.group_pids()) == 3)
    t0 = time.monotonic()
    engine.kill()
    assert group_pids(engine.pid) == []
    assert time.monotonic() - t0 < 10  # no grace period: SIGKILL at once


def test_lines_arrive_as_they_are_printed() -> None:
    script = (
        "import time\nfor i in range(3):\n    print('line', i, flush=True)\n    time.sleep(0.3)\n"
    )
    seen: list[tuple[float, str]] = []
    engine = EngineProcess(
        [sys.executable, "-c", script], on_line=lambda s: seen.append((time.monotonic(), s))
    )
    engine.start()
    assert engine.wait_exit(30) == 0
    engine.wait_output_done()
    assert [s for _, s in seen] == ["line 0", "line 1", "line 2"]
    assert seen[2][0] - seen[0][0] > 0.3  # streamed, not delivered at exit
    assert engine.tail(2) == ["line 1", "line 2"]


def test_missing_executable_is_a_clear_error(tmp_path: Path) -> None:
    engine = EngineProcess([str(tmp_path / "no-such-vllm"), "serve"])
    with pytest.raises(EngineStartError) as info:
        engine.start()
    assert "no-such-vllm" in info.value.one_line()
    assert info.value.exit_code == EXIT_ENGINE_FAILED


def test_wait_healthy_sees_health_and_an_early_exit() -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        sleeper = EngineProcess([sys.executable, "-c", "import time; time.sleep(60)"])
        sleeper.start()
        assert sleeper.wait_healthy(url, timeout_s=30)
        sleeper.stop(grace_s=1)
        quitter = EngineProcess([sys.executable, "-c", "raise SystemExit(3)"])
        quitter.start()
        t0 = time.monotonic()
        assert not quitter.wait_healthy(url + "-never", timeout_s=60)
        assert time.monotonic() - t0 < 30  # returned at the exit, not at the timeout
        assert quitter.returncode == 3
    finally:
        server.shutdown()


def test_a_helper_started_with_start_group_is_stopped_whole() -> None:
    proc = start_group([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("started")
    assert _wait(lambda: len(group_pids(proc.pid)) == 3)
    stop_group(proc.pid, grace_s=1.0, leader=proc)
    assert group_pids(proc.pid) == []
    assert proc.returncode is not None  # the leader was reaped
    assert signal_group(2**22 + 1, signal.SIGTERM) is False  # above pid_max: no such group


def test_kill_group_is_immediate_and_start_group_always_starts_a_new_group() -> None:
    proc = start_group([sys.executable, "-c", TREE], stdout=subprocess.DEVNULL)
    assert _wait(lambda: len(group_pids(proc.pid)) == 3)
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    t0 = time.monotonic()
    kill_group(proc.pid, leader=proc)
    assert group_pids(proc.pid) == [] and proc.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="new session"):
        start_group([sys.executable, "-c", "pass"], start_new_session=False)


def test_a_group_that_outlives_sigkill_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import oomguard.engine.process as process

    monkeypatch.setattr(process, "group_pids", lambda pgid: [pgid])  # a process in D state
    monkeypatch.setattr(process.time, "sleep", lambda s: None)
    with pytest.raises(EngineLeftBehind) as info:
        kill_group(2**22 + 1)
    assert info.value.exit_code == EXIT_ENGINE_FAILED and "left after SIGKILL" in str(info.value)
