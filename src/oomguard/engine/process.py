"""Start, read and stop one engine process group (vLLM, llama-server).

An engine is a tree of processes: vLLM's API server starts an engine core, which starts
workers; a tensor-parallel run has one worker per GPU. Killing only the first leaves the
others holding GPU memory. So an engine always runs in a process group of its own
(``start_new_session``), and every stop acts on the whole group and checks that nothing of it
is left. :func:`start_group`, :func:`stop_group` and :func:`kill_group` do this for any process
(an engine, a gateway, a test's helper server); :class:`EngineProcess` adds output reading and
health waiting on top.

Output (stdout and stderr merged, as a terminal shows them) is read by one thread, line by
line, as it comes: each line goes to the log file (when given), to a bounded tail kept in
memory, and to the ``on_line`` callbacks (serve's phase display and log parser).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from oomguard.errors import BadInput, EngineFailed

LineCallback = Callable[[str], None]

TAIL_LINES = 400


class EngineStartError(EngineFailed):
    """The engine's executable could not be started at all (missing, not executable)."""


class EngineLeftBehind(EngineFailed):
    """Processes of the engine's group survived SIGKILL (they may still hold GPU memory)."""


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid`` (read from ``/proc``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the parenthesised command: state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] != "Z":
            pids.append(int(entry.name))
    return pids


def start_group(argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` in a session and process group of its own (its pid is the group id).

    ``popen`` goes to :class:`subprocess.Popen` as given (stdout, env, cwd, text …).
    """
    if "start_new_session" in popen or "preexec_fn" in popen:
        raise ValueError("start_group always starts a new session")
    return subprocess.Popen([str(a) for a in argv], start_new_session=True, **popen)


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to every process of group ``pgid``; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _reap(leader: subprocess.Popen[Any] | None, timeout_s: float) -> None:
    if leader is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            leader.wait(timeout=timeout_s)


def stop_group(
    pgid: int, grace_s: float = 10.0, *, leader: subprocess.Popen[Any] | None = None
) -> None:
    """SIGTERM the whole group ``pgid``, SIGKILL what is left after ``grace_s``, and check.

    ``leader``, the process that started the group, is reaped. Raises
    :class:`EngineLeftBehind` if any process of the group survives SIGKILL.
    """
    if group_pids(pgid):
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_pids(pgid):
            if leader is not None:
                _reap(leader, 0.1)
            else:
                time.sleep(0.05)
    _kill_remaining(pgid, leader)


def kill_group(pgid: int, *, leader: subprocess.Popen[Any] | None = None) -> None:
    """SIGKILL the whole group ``pgid`` at once and check, as :func:`stop_group` does."""
    signal_group(pgid, signal.SIGKILL)
    _kill_remaining(pgid, leader)


def _kill_remaining(pgid: int, leader: subprocess.Popen[Any] | None) -> None:
    if group_pids(pgid):
        signal_group(pgid, signal.SIGKILL)
    _reap(leader, 5.0)
    deadline = time.monotonic() + 5.0
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = group_pids(pgid)
    if left:
        raise EngineLeftBehind(f"engine processes left after SIGKILL: {left}")


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET ``url`` answers 200 within ``timeout_s`` (any error counts as no)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class EngineProcess:
    """One engine process group: start it, follow its output, wait for health, stop it.

    ``argv`` runs as given with ``env`` (default: this process's environment) in a new
    session, so the child's pid is also its process-group id. ``log_path`` receives every
    line; ``on_line`` callbacks run on the reader thread and must be quick.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        on_line: LineCallback | None = None,
    ) -> None:
        if not argv:
            raise BadInput("empty engine command", "give the command that starts the engine")
        self.argv = [str(a) for a in argv]
        self.env = dict(os.environ if env is None else env)
        self.log_path = log_path
        self.cwd = cwd
        self._callbacks: list[LineCallback] = [on_line] if on_line else []
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._lines_seen = 0
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None  # time.monotonic() at start
        self.ended_at: float | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the command in its own process group and start reading its output.

        Raises :class:`EngineStartError` when the executable cannot be run.
        """
        if self.proc is not None:
            raise RuntimeError("engine already started")
        log: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")  # noqa: SIM115 - closed by the reader thread
        try:
            self.proc = start_group(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=str(self.cwd) if self.cwd else None,
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            if log is not None:
                log.close()
            raise EngineStartError(
                f"cannot run {self.argv[0]!r}: {exc.strerror or exc}",
                "check that the engine is installed and the path is right",
            ) from None
        self.started_at = time.monotonic()
        self._reader = threading.Thread(
            target=self._read_output,
            args=(self.proc.stdout, log),
            daemon=True,
            name=f"engine-{self.proc.pid}-output",
        )
        self._reader.start()

    def add_line_callback(self, callback: LineCallback) -> None:
        """Also call ``callback`` with every line read from now on."""
        with self._lock:
            self._callbacks.append(callback)

    def _read_output(self, stream: IO[bytes] | None, log: IO[bytes] | None) -> None:
        try:
            if stream is None:
                return
            for raw in iter(stream.readline, b""):
                if log is not None:
                    log.write(raw)
                    log.flush()
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._lock:
                    self._tail.append(line)
                    self._lines_seen += 1
                    callbacks = list(self._callbacks)
                for callback in callbacks:
                    with contextlib.suppress(Exception):  # a display bug must not stop reading
                        callback(line)
        finally:
            if log is not None:
                log.close()

    # --- state -------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Pid of the first process; also the process-group id."""
        if self.proc is None:
            raise RuntimeError("engine not started")
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The first process's exit code, or None while it runs."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return code

    @property
    def running(self) -> bool:
        """Whether the first process is still alive."""
        return self.proc is not None and self.returncode is None

    @property
    def lines_seen(self) -> int:
        """How many output lines have been read so far."""
        with self._lock:
            return self._lines_seen

    def tail(self, n: int = 40) -> list[str]:
        """The last ``n`` output lines."""
        with self._lock:
            return list(self._tail)[-n:]

    def group_pids(self) -> list[int]:
        """Live processes of the engine's group."""
        return group_pids(self.pid) if self.proc is not None else []

    def elapsed_s(self) -> float:
        """Seconds since start."""
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    # --- waiting -----------------------------------------------------------------------

    def wait_healthy(
        self,
        url: str,
        timeout_s: float,
        *,
        poll_s: float = 0.25,
        give_up: Callable[[], bool] | None = None,
    ) -> bool:
        """Poll ``url`` until it answers 200: True when healthy, False when the process
        exited, ``give_up()`` returned True, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running or (give_up is not None and give_up()):
                return False
            if http_ok(url, timeout_s=min(2.0, max(poll_s, 0.5))):
                return True
            time.sleep(poll_s)
        return False

    def wait_exit(self, timeout_s: float | None = None) -> int | None:
        """Wait for the first process to exit; its code, or None on timeout."""
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        if self.ended_at is None:
            self.ended_at = time.monotonic()
        return code

    def wait_output_done(self, timeout_s: float = 5.0) -> None:
        """Wait until the reader has seen the end of the output (all writers closed it)."""
        if self._reader is not None:
            self._reader.join(timeout_s)

    # --- stopping ----------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole group, SIGKILL what is left after ``grace_s``, and check.

        Raises :class:`EngineLeftBehind` if any process of the group survives SIGKILL.
        """
        if self.proc is None:
            return
        try:
            stop_group(self.pid, grace_s, leader=self.proc)
        finally:
            self._stopped()

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, or a failure seen in the log)."""
        if self.proc is None:
            return
        try:
            kill_group(self.pid, leader=self.proc)
        finally:
            self._stopped()

    def _stopped(self) -> None:
        self.wait_exit(0)
        self.wait_output_done(2.0)
