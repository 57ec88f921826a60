"""A real ``redis-server`` for the tests: its own port and directory, no persistence.

``RedisServer`` starts one (skipped, or failed under ``OOMGUARD_REQUIRE_ALL=1``, when the
program is missing: ``scripts/setup-system.sh`` installs it), can SIGKILL it and start it again
on the same port, and always stops it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from oomguard.engine import kill_group, start_group, stop_group


def redis_server_path() -> str:
    """The ``redis-server`` program; skips (or fails when everything must be installed)."""
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server not found (scripts/setup-system.sh installs package redis-server)"
        if os.environ.get("OOMGUARD_REQUIRE_ALL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1 (``url``)."""

    def __init__(self, workdir: Path) -> None:
        self.program = redis_server_path()
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = start_group(
            [
                self.program,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL: the server and everything it held are gone."""
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc.pid, leader=self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_group(self.proc.pid, grace_s=5, leader=self.proc)
