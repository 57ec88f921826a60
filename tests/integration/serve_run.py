"""Run ``oomguard serve --json`` as a real subprocess and follow its events.

``ServeRun`` starts the CLI in a process group of its own, reads one JSON event per stdout
line on a thread, and lets a test wait for an event. On exit it stops serve with SIGTERM and
then makes sure no engine it launched is left (every launch's process group is checked and,
if anything survived, killed and reported as a test failure).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oomguard.engine import group_pids, signal_group, start_group

Event = dict[str, Any]


class ServeRun:
    """One ``oomguard serve --json …`` process and the events it printed."""

    def __init__(
        self,
        oomguard_exe: Sequence[str],
        args: Sequence[str],
        *,
        home: Path,
        venv: Path,
        log_dir: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.argv = [*oomguard_exe, "serve", "--json", "--log-dir", str(log_dir), *args]
        env = dict(os.environ)
        env.update(
            {
                "OOMGUARD_HOME": str(home),
                "OOMGUARD_VLLM_PYTHON": str(venv / "bin" / "python"),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        for name in ("VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES"):
            env.pop(name, None)
        env.update(extra_env or {})
        self.env = env
        self.events: list[Event] = []
        self.stderr = ""
        self._cond = threading.Condition()
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ServeRun:
        self.proc = start_group(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate(timeout_s=120.0)
        left = self.engine_processes_left()
        for pgid in self.engine_groups():
            signal_group(pgid, signal.SIGKILL)
        assert not left, f"engine processes left after serve ended: {left}"

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = {"event": "unparsed", "text": line}
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    # --- waiting ----------------------------------------------------------------------------
    def wait_for(
        self,
        kind: str,
        timeout_s: float,
        where: Callable[[Event], bool] = lambda e: True,
        after: int = 0,
    ) -> Event:
        """The first event of ``kind`` (index ≥ ``after``) that satisfies ``where``; fails the
        test with the events so far when serve exits or time runs out first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for event in self.events[after:]:
                    if event.get("event") == kind and where(event):
                        return event
                exited = self.proc is not None and self.proc.poll() is not None
                if exited and (self._reader is None or not self._reader.is_alive()):
                    raise AssertionError(f"serve exited before {kind}: {self.summary()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {kind} event in {timeout_s:.0f} s: {self.summary()}")
                self._cond.wait(min(left, 1.0))

    def of_kind(self, kind: str) -> list[Event]:
        """Every event of ``kind`` so far."""
        with self._cond:
            return [e for e in self.events if e.get("event") == kind]

    def summary(self) -> str:
        """The events so far, one short line each (for failure messages)."""
        lines = []
        for e in self.events:
            detail = {
                k: e[k]
                for k in ("command", "signature", "text", "change", "reason", "code")
                if k in e
            }
            lines.append(f"{e.get('event')}: {json.dumps(detail)[:300]}")
        return "\n" + "\n".join(lines) + f"\nstderr: {self.stderr[-1500:]}"

    # --- stopping ---------------------------------------------------------------------------
    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to serve itself."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def terminate(self, timeout_s: float = 120.0) -> int:
        """SIGTERM serve (if it runs) and wait for its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(timeout=30)
        if self._reader is not None:
            self._reader.join(10)
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self.stderr = self.proc.stderr.read()
        return code

    def wait_exit(self, timeout_s: float) -> int:
        """Wait for serve to exit by itself."""
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout_s)
        if self._reader is not None:
            self._reader.join(10)
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self.stderr = self.proc.stderr.read()
        return code

    def engine_groups(self) -> list[int]:
        """Process-group ids of every engine serve launched (the launch events' pids)."""
        return [int(e["pid"]) for e in self.of_kind("launch")] + [
            int(e["pid"]) for e in self.of_kind("guard")
        ]

    def engine_processes_left(self) -> list[int]:
        """Live processes of any launched engine's (or the guard's) group."""
        return [pid for pgid in self.engine_groups() for pid in group_pids(pgid)]
