"""The engine-independent part of a serve run: launch, follow, kill on a failure line, heal,
supervise, stop.

:class:`LaunchLoop` owns the engine process (through :class:`oomguard.engine.EngineProcess`),
feeds its log to the engine's reader as it is written, and reports everything as
:mod:`~oomguard.serve.events`. The loop:

1. launch the command; follow the log: phases, each stated number beside its prediction;
2. on a memory failure, SIGKILL the whole process group from the reader thread on the line
   that reports it, wait until the memory is back, and ask the heal for the next
   configuration; relaunch, at most ``max_attempts`` launches, never one twice;
3. when the health URL answers: store what was measured, probe, start the guard;
4. supervise: a crash is restarted with backoff (a bounded number in a window), healed first
   when its log shows a memory failure; a crash that is not memory and repeats at the same
   point (the first request) stops serve with its diagnosis instead of a restart into it; a
   stop request stops everything and checks that nothing of the engine is left.

What differs between engines — the command, the prediction, how numbers are compared, the heal,
probes and what is recorded — are the hooks a subclass implements: vLLM's is
:class:`oomguard.serve.session.ServeSession`, llama.cpp's
:class:`oomguard.serve.llama_session.LlamaServeSession`.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from oomguard.doctor.not_memory import EngineFault, engine_fault
from oomguard.engine import (
    EngineLeftBehind,
    EngineProcess,
    Release,
    gpu_memory,
    http_ok,
    signal_group,
    wait_memory_released,
)
from oomguard.errors import BadInput, OomguardError
from oomguard.logs import ParsedLog, Phase
from oomguard.logs.catalogue import REQUEST_ANSWERED
from oomguard.logs.follow import Failure, LineNews
from oomguard.serve.events import EventHandler, EventLog
from oomguard.serve.heal import HealWorkload

EXIT_STOPPED = 0
EXIT_NOT_STARTED = 1
# where an engine died: before it was healthy, before it answered any request, later on
START_UP, FIRST_REQUEST, SERVING = "start-up", "first request", "serving"
LineSink = Any  # Callable[[str], None]


class LaunchCommand(Protocol):
    """What the loop needs from an engine command (vLLM's or llama-server's)."""

    @property
    def model(self) -> str:
        """The model it serves."""
        ...

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server."""
        ...

    @property
    def port(self) -> int:
        """The port it listens on."""
        ...

    @property
    def bind_host(self) -> str:
        """The address it binds."""
        ...

    def key(self) -> str:
        """What makes two commands the same configuration."""
        ...

    def display(self) -> str:
        """The command as the user would type it."""
        ...


class LogReader(Protocol):
    """Reads an engine's log line by line as it is written (one thread feeds it)."""

    @property
    def failure(self) -> Failure | None:
        """The first memory failure seen so far."""
        ...

    def feed(self, chunk: str) -> LineNews:
        """Take one line; return what it showed (phases, numbers, a failure)."""
        ...

    def parsed(self) -> ParsedLog:
        """Everything read so far."""
        ...


class Predicted(Protocol):
    """A prediction as the loop reports it."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        ...


C = TypeVar("C", bound=LaunchCommand)
P = TypeVar("P", bound=Predicted)
C_contra = TypeVar("C_contra", bound=LaunchCommand, contravariant=True)


class EngineKind(Protocol[C_contra]):
    """What the loop needs from an engine to start one of its commands."""

    name: str
    version: str

    def argv(self, command: C_contra) -> list[str]:
        """The process to start for ``command``."""
        ...

    def environment(self, command: C_contra) -> dict[str, str]:
        """The environment to start it with."""
        ...

    def health_url(self, command: C_contra) -> str:
        """A URL that answers 200 once the server serves."""
        ...

    def new_reader(self) -> LogReader:
        """A fresh reader of this engine's log."""
        ...


K = TypeVar("K", bound="EngineKind[Any]")


@dataclass
class ServeOptions:
    """How to serve: the command (or the model to plan for), the workload, the limits."""

    command: Any = None  # an EngineCommand (vLLM) or a LlamaCommand (llama-server)
    model: str | None = None  # plan first, then launch what the plan recommends
    plan_settings: dict[str, Any] = field(default_factory=dict)  # EngineSettings fields
    engine_args: tuple[str, ...] = ()  # extra engine flags for the planned command
    host: str | None = None
    port: int | None = None
    workload: HealWorkload = field(default_factory=HealWorkload)
    max_attempts: int = 3
    probe: bool | None = None  # None: on when a workload is given
    calibrate: bool = True
    use_calibration: bool = True
    allow_precision_change: bool = False  # heal may change quantization / KV dtype / dtype
    guard_port: int | None = None
    max_restarts: int = 5
    restart_window_s: float = 600.0
    startup_timeout_s: float = 1800.0
    stop_grace_s: float = 30.0
    log_dir: Path | None = None
    vllm_python: str | None = None
    allow_hub: bool = True
    dry_run: bool = False
    engine: str = "auto"  # "auto" | "vllm" | "llama.cpp"
    gguf: Path | None = None  # the GGUF the llama.cpp tiers run (MODEL form)
    llama_server: str | None = None  # the llama-server binary

    def validate(self) -> None:
        """Raise :class:`BadInput` for limits that make no sense."""
        if (self.command is None) == (self.model is None):
            raise BadInput(
                "give either MODEL or a command after --",
                "oomguard serve MODEL …  or  oomguard serve -- vllm serve MODEL …",
            )
        if self.max_attempts < 1:
            raise BadInput(
                f"--max-attempts {self.max_attempts} must be at least 1", "pass 1 or more"
            )
        if self.max_restarts < 0 or self.restart_window_s <= 0:
            raise BadInput(
                "--max-restarts must be 0 or more and --restart-window positive",
                "e.g. --max-restarts 5 --restart-window 600",
            )
        for name, port in (("--port", self.port), ("--guard-port", self.guard_port)):
            if port is not None and not 0 < port < 65536:
                raise BadInput(f"{name} {port} is not a port number", "pass 1-65535")
        if self.engine not in ("auto", "vllm", "llama.cpp"):
            raise BadInput(
                f"--engine {self.engine} is not an engine serve launches",
                "pass --engine auto, vllm or llama.cpp",
            )


@dataclass
class LaunchResult:
    """How one launch ended."""

    status: str  # "ready" | "memory_failure" | "exited" | "stopped" | "timeout"
    parsed: ParsedLog
    failure: Failure | None = None
    returncode: int | None = None
    point: str | None = None  # START_UP, FIRST_REQUEST or SERVING (a launch that ended badly)
    fault: EngineFault | None = None  # a failure the log shows that is not memory


@dataclass
class Launch(Generic[C, P]):
    """The engine process of one launch and what its reader thread shares."""

    number: int
    command: C
    process: EngineProcess
    follower: LogReader
    prediction: P | None
    log_path: Path
    news: queue.Queue[tuple[float, LineNews]] = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    failure_read_at: float | None = None  # monotonic time the failure line was read
    killed_at: float | None = None  # monotonic time SIGKILL was sent to the group
    # each GPU's used memory before the launch (NVML), so the memory's return can be seen
    # where NVML lists no process of ours (containers)
    used_before: dict[int, int] | None = None
    answered: int = 0  # generation requests the engine's log shows answered

    def parsed(self) -> ParsedLog:
        """The launch's log so far (safe while the reader thread feeds it)."""
        with self.lock:
            return self.follower.parsed()

    def wait_released(self, pids: list[int]) -> Release:
        """Wait until the memory this launch's processes held is free again."""
        return wait_memory_released(pids, timeout_s=60.0, used_before_start=self.used_before)


class LaunchLoop(Generic[C, P, K]):
    """Runs one serve (see the module docstring); :meth:`run` returns the exit code.

    ``engine`` is the engine to serve with, or None for :meth:`_prepare` to find; subclasses
    set it there at the latest and implement the hooks below the line ``engine-specific hooks``.
    """

    phase_labels: dict[Phase, str] = {}

    def __init__(
        self,
        options: ServeOptions,
        *,
        handlers: list[EventHandler] | None = None,
        line_sink: LineSink | None = None,
        engine: K | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        options.validate()
        self.options = options
        self.engine: K | None = engine
        self.events = EventLog(handlers)
        self.line_sink = line_sink
        self.command: C | None = options.command
        self.stop_requested = stop_event or threading.Event()
        self.launches: list[Launch[C, P]] = []
        self.tried: dict[str, int] = {}
        self.current: Launch[C, P] | None = None
        self.guard: EngineProcess | None = None
        self.log_dir = options.log_dir or default_log_dir()
        self._probed: set[str] = set()

    @property
    def kind(self) -> K:
        """The engine being served (set by :meth:`_prepare`)."""
        assert self.engine is not None
        return self.engine

    # --- engine-specific hooks ------------------------------------------------------------
    def _prepare(self) -> None:
        """Find the engine, settle the command, check it, emit the ``plan`` event."""
        raise NotImplementedError

    def _predict(self, command: C) -> P | None:
        """The prediction for ``command`` on this machine now (None: none can be made)."""
        raise NotImplementedError

    def _report_news(self, launch: Launch[C, P], state: PhaseState, news: LineNews) -> None:
        """Turn one line's news into ``phase`` / ``observed`` / ``compare`` events."""
        raise NotImplementedError

    def _comparison(self, launch: Launch[C, P], parsed: ParsedLog) -> list[dict[str, Any]]:
        """Predicted against observed, every figure the log stated so far (``compare`` rows)."""
        raise NotImplementedError

    def _heal(self, command: C, result: LaunchResult) -> C | None:
        """The next configuration after the memory failure in ``result`` (emits ``heal``)."""
        raise NotImplementedError

    def _alternatives(self, command: C) -> None:
        """What ``plan`` proposes instead (emits ``alternatives``)."""
        raise NotImplementedError

    def _store_calibration(self, launch: Launch[C, P]) -> None:
        """Keep what the ready launch measured for the next prediction."""

    def _run_probes(self, launch: Launch[C, P]) -> None:
        """Probe the ready server with the worst requests its configuration admits."""

    def _guard_argv(self, command: C, port: int) -> list[str]:
        """The guard to start in front of ``command``."""
        return [
            sys.executable,
            "-m",
            "oomguard.cli",
            "guard",
            "--backend",
            command.base_url,
            "--port",
            str(port),
        ]

    # --- public --------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the session to stop the engine (and the guard) and return (thread-safe)."""
        self.stop_requested.set()

    def run(self) -> int:
        """Serve until stopped or until the engine cannot be made to start; the exit code."""
        try:
            self._prepare()
        except OomguardError as exc:
            self.events.emit("exit", code=exc.exit_code, reason=exc.one_line())
            raise
        if self.options.dry_run:
            self.events.emit("exit", code=0, reason="dry run: nothing launched")
            return 0
        try:
            code, reason = self._serve()
        finally:
            self._shutdown()
        self.events.emit("exit", code=code, reason=reason)
        return code

    # --- the serve loop ------------------------------------------------------------------
    def _serve(self) -> tuple[int, str]:
        restarts: deque[float] = deque()
        assert self.command is not None
        command = self.command
        previous: LaunchResult | None = None
        while True:
            started = self._start(command)
            if started is None:
                return EXIT_STOPPED, "stopped"
            if isinstance(started, str):
                return EXIT_NOT_STARTED, started
            command = started
            if not self._after_ready(command):
                return EXIT_STOPPED, "stopped"
            crashed = self._supervise()
            if crashed is None:
                return EXIT_STOPPED, "stopped"
            repeated = _repeated_crash(previous, crashed)
            if repeated is not None:
                return EXIT_NOT_STARTED, repeated
            previous = crashed
            now = time.monotonic()
            while restarts and now - restarts[0] > self.options.restart_window_s:
                restarts.popleft()
            if len(restarts) >= self.options.max_restarts:
                return EXIT_NOT_STARTED, (
                    f"the engine crashed {len(restarts) + 1} times within "
                    f"{self.options.restart_window_s:g} s; not restarting again"
                )
            restarts.append(now)
            # 1, 2, 4 … 30 s: the more crashes in the window, the longer the wait
            backoff_s = min(2.0 ** (len(restarts) - 1), 30.0)
            command = self._after_crash(command, crashed, backoff_s)
            if self.stop_requested.is_set():
                return EXIT_STOPPED, "stopped"

    def _start(self, command: C) -> C | str | None:
        """Launch ``command``, healing memory failures; the command that became ready, a
        reason it could not, or None when stopped."""
        for attempt in range(1, self.options.max_attempts + 1):
            result = self._launch(command, attempt)
            if result.status == "ready":
                return command
            if result.status == "stopped":
                return None
            if result.status != "memory_failure":
                return _not_memory_reason(result)
            if attempt == self.options.max_attempts:
                break
            healed = self._heal(command, result)
            if healed is None:
                self._alternatives(command)
                return "no configuration left to try (see the heal's rejected changes)"
            command = healed
        self._alternatives(command)
        return f"still failing after {self.options.max_attempts} launches (--max-attempts)"

    # --- one launch ----------------------------------------------------------------------
    def _before_launch(self) -> None:
        """Refresh what the prediction reads about the machine (free memory)."""

    def _launch(self, command: C, attempt: int) -> LaunchResult:
        engine = self.kind
        number = len(self.launches) + 1
        self._before_launch()
        prediction = self._predict(command)
        log_path = self.log_dir / f"launch-{number}.log"
        process = EngineProcess(
            engine.argv(command), env=engine.environment(command), log_path=log_path
        )
        launch: Launch[C, P] = Launch(
            number, command, process, engine.new_reader(), prediction, log_path
        )
        process.add_line_callback(lambda line: self._on_line(launch, line))
        self.launches.append(launch)
        self.tried.setdefault(command.key(), number)
        self.current = launch
        devices = gpu_memory()
        launch.used_before = {d.index: d.used_bytes for d in devices} if devices else None
        launch.process.start()
        self.events.emit(
            "launch",
            number=number,
            attempt=attempt,
            max_attempts=self.options.max_attempts,
            command=command.display(),
            argv=launch.process.argv,
            pid=launch.process.pid,
            log=str(log_path),
            prediction=prediction.to_dict() if prediction else None,
            engine=engine.name,
        )
        return self._follow(launch)

    def _on_line(self, launch: Launch[C, P], line: str) -> None:
        """Reader thread: parse the line; on a memory failure kill the group at once."""
        read_at = time.monotonic()
        with launch.lock:
            news = launch.follower.feed(line)
            if "POST /v1/" in line and REQUEST_ANSWERED.search(line):
                launch.answered += 1
        if news.failure is not None and launch.killed_at is None:
            launch.failure_read_at = read_at
            signal_group(launch.process.pid, signal.SIGKILL)
            launch.killed_at = time.monotonic()
        if self.line_sink is not None:
            self.line_sink(line)
        if not news.empty:
            launch.news.put((read_at, news))

    def _follow(self, launch: Launch[C, P]) -> LaunchResult:
        """Wait for the launch to become healthy, fail, exit, time out or be stopped."""
        health = self.kind.health_url(launch.command)
        state = PhaseState()
        deadline = time.monotonic() + self.options.startup_timeout_s
        next_health = 0.0
        while True:
            self._drain(launch, state, timeout_s=0.2)
            if launch.killed_at is not None:
                return self._failed(launch, state)
            if self.stop_requested.is_set():
                self._stop_process(launch.process)
                return LaunchResult("stopped", launch.parsed())
            if not launch.process.running:
                launch.process.wait_output_done(5.0)
                self._drain(launch, state, timeout_s=0.0)
                return self._exited(launch, state)
            now = time.monotonic()
            if now >= next_health:
                next_health = now + 0.5
                if http_ok(health, timeout_s=1.0):
                    self._drain(launch, state, timeout_s=0.0)
                    self._ready(launch, state)
                    return LaunchResult("ready", launch.parsed())
            if now > deadline:
                launch.process.kill()
                self.events.emit(
                    "failure",
                    kind="timeout",
                    launch=launch.number,
                    text=f"not healthy after {self.options.startup_timeout_s:g} s",
                )
                return LaunchResult("timeout", launch.parsed())

    def _drain(self, launch: Launch[C, P], state: PhaseState, timeout_s: float) -> None:
        """Turn queued line news into phase / observed / compare events."""
        try:
            _, news = (
                launch.news.get(timeout=timeout_s) if timeout_s > 0 else launch.news.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._report_news(launch, state, news)
            try:
                _, news = launch.news.get_nowait()
            except queue.Empty:
                return

    def _report_phases(self, launch: Launch[C, P], state: PhaseState, news: LineNews) -> None:
        """``phase`` events for the phases the line reached (each once, in order)."""
        for phase, evidence in news.phases:
            if state.advance(phase):
                self.events.emit(
                    "phase",
                    launch=launch.number,
                    phase=phase.value,
                    label=self.phase_labels.get(phase, phase.value),
                    line=evidence.line,
                )

    # --- outcomes of a launch ------------------------------------------------------------
    def _failed(self, launch: Launch[C, P], state: PhaseState) -> LaunchResult:
        """A memory failure was read and the group SIGKILLed: make sure nothing is left and
        the memory is back, then report it with the timings."""
        pids = launch.process.group_pids() + [launch.process.pid]
        try:
            launch.process.kill()
        except EngineLeftBehind as exc:
            self.events.emit("note", text=str(exc))
        gone_at = time.monotonic()
        release = launch.wait_released(pids)
        self._drain(launch, state, timeout_s=0.0)
        parsed = launch.parsed()
        failure = launch.follower.failure
        assert failure is not None and launch.failure_read_at is not None
        self.events.emit(
            "failure",
            kind="memory",
            launch=launch.number,
            signature=failure.signature,
            line=failure.evidence.line,
            text=failure.evidence.text,
            phase=parsed.failure_phase.value.value if parsed.failure_phase else None,
            line_to_kill_s=round((launch.killed_at or gone_at) - launch.failure_read_at, 4),
            line_to_gone_s=round(gone_at - launch.failure_read_at, 4),
            memory_released=release.released,
            release_source=release.source,
            release_wait_s=round(release.waited_s, 3),
            log=str(launch.log_path),
            comparison=self._comparison(launch, parsed),
        )
        return LaunchResult("memory_failure", parsed, failure, launch.process.returncode)

    def _exited(self, launch: Launch[C, P], state: PhaseState) -> LaunchResult:
        """The engine exited by itself before it was healthy."""
        pids = launch.process.group_pids() + [launch.process.pid]
        try:
            launch.process.stop(grace_s=5.0)
        except EngineLeftBehind as exc:
            self.events.emit("note", text=str(exc))
        launch.wait_released(pids)
        parsed = launch.parsed()
        code = launch.process.returncode
        failure = launch.follower.failure
        memory = failure is not None or parsed.shows_failure
        fault = None if memory else engine_fault(parsed)
        errors = [e.text for e in parsed.errors[:3]] or launch.process.tail(5)
        self.events.emit(
            "failure",
            kind="memory" if memory else "exited",
            launch=launch.number,
            returncode=code,
            signature=failure.signature if failure else None,
            line=failure.evidence.line if failure else None,
            text=failure.evidence.text if failure else " | ".join(errors)[:800],
            log=str(launch.log_path),
            point=START_UP,
            not_memory=fault.to_dict() if fault else None,
        )
        status = "memory_failure" if memory else "exited"
        return LaunchResult(status, parsed, failure, code, START_UP, fault)

    def _ready(self, launch: Launch[C, P], state: PhaseState) -> None:
        parsed = launch.parsed()
        self.events.emit(
            "ready",
            launch=launch.number,
            url=launch.command.base_url,
            command=launch.command.display(),
            pid=launch.process.pid,
            startup_s=round(launch.process.elapsed_s(), 2),
            comparison=self._comparison(launch, parsed),
        )

    # --- once ready ----------------------------------------------------------------------
    def _after_ready(self, command: C) -> bool:
        """Store what was measured, probe, start the guard; False when stopped meanwhile."""
        launch = self.current
        assert launch is not None
        self._store_calibration(launch)
        if self._probe_enabled() and command.key() not in self._probed:
            self._probed.add(command.key())
            self._run_probes(launch)
        if self.options.guard_port is not None and self.guard is None:
            self._start_guard(command)
        return not self.stop_requested.is_set()

    def _probe_enabled(self) -> bool:
        if self.options.probe is not None:
            return self.options.probe
        w = self.options.workload
        return w.p99_tokens is not None or w.concurrency is not None

    def _start_guard(self, command: C) -> None:
        port = self.options.guard_port
        assert port is not None
        log_path = self.log_dir / "guard.log"
        guard = EngineProcess(self._guard_argv(command, port), log_path=log_path)
        guard.start()
        self.guard = guard
        url = f"http://127.0.0.1:{port}"
        healthy = guard.wait_healthy(url + "/health", timeout_s=60.0)
        self.events.emit(
            "guard",
            url=url,
            pid=guard.pid,
            healthy=healthy,
            backend=command.base_url,
            log=str(log_path),
            tail=[] if healthy else guard.tail(5),
        )

    # --- supervision ---------------------------------------------------------------------
    def _supervise(self) -> LaunchResult | None:
        """Wait while the engine serves; the crash, or None when a stop was requested."""
        launch = self.current
        assert launch is not None
        state = PhaseState(Phase.SERVING)
        while not self.stop_requested.wait(0.5):
            self._drain(launch, state, timeout_s=0.0)
            if launch.process.running and launch.killed_at is None:
                continue
            pids = launch.process.group_pids()
            try:
                launch.process.kill()
            except EngineLeftBehind as exc:
                self.events.emit("note", text=str(exc))
            launch.wait_released(pids + [launch.process.pid])
            return self._crashed(launch)
        return None

    def _crashed(self, launch: Launch[C, P]) -> LaunchResult:
        """Report the crash of a launch that was serving: memory or not, and where."""
        parsed = launch.parsed()
        failure = launch.follower.failure
        fault = None if failure else engine_fault(parsed)
        answered = launch.answered
        point = FIRST_REQUEST if answered == 0 else SERVING
        code = launch.process.returncode
        self.events.emit(
            "failure",
            kind="memory" if failure else "crash",
            launch=launch.number,
            returncode=code,
            signature=failure.signature if failure else None,
            line=failure.evidence.line if failure else None,
            text=failure.evidence.text if failure else " | ".join(launch.process.tail(3))[:800],
            log=str(launch.log_path),
            point=point,
            requests_answered=answered,
            not_memory=fault.to_dict() if fault else None,
        )
        status = "memory_failure" if failure else "exited"
        return LaunchResult(status, parsed, failure, code, point, fault)

    def _after_crash(self, command: C, crashed: LaunchResult, backoff_s: float) -> C:
        """Wait the backoff; heal first when the crash was a memory failure."""
        new = command
        if crashed.status == "memory_failure":
            healed = self._heal(command, crashed)
            new = healed or command
        self.events.emit(
            "restart", after_s=backoff_s, command=new.display(), healed=new is not command
        )
        self.stop_requested.wait(backoff_s)
        return new

    # --- stopping ------------------------------------------------------------------------
    def _stop_process(self, process: EngineProcess) -> None:
        try:
            process.stop(grace_s=self.options.stop_grace_s)
        except EngineLeftBehind as exc:
            self.events.emit("note", text=str(exc))

    def _shutdown(self) -> None:
        """Stop the guard and the engine (whole groups) and wait for the memory."""
        if self.guard is not None:
            self._stop_process(self.guard)
        launch = self.current
        if launch is not None and launch.process.proc is not None:
            pids = launch.process.group_pids()
            if pids:
                self._stop_process(launch.process)
                launch.wait_released(pids)


class PhaseState:
    """The phase shown: it only moves forward, and a phase after weight loading counts only
    once the weights are loading (an engine config line mentions CUDA-graph settings long
    before any graph is captured)."""

    def __init__(self, start: Phase | None = None) -> None:
        self.phase = start

    def advance(self, phase: Phase) -> bool:
        """Move to ``phase`` if it comes later (see the class docstring); whether it moved."""
        current = self.phase
        if current is not None and phase.rank <= current.rank:
            return False
        after_weights = phase.rank > Phase.WEIGHT_LOADING.rank and phase is not Phase.SERVING
        if after_weights and (current is None or current.rank < Phase.WEIGHT_LOADING.rank):
            return False
        self.phase = phase
        return True


def _repeated_crash(before: LaunchResult | None, now: LaunchResult) -> str | None:
    """Why serve stops instead of restarting: the engine died twice in a row before its first
    answer, with no memory failure either time (a restart would die the same way); or None."""
    if before is None or "memory_failure" in (before.status, now.status):
        return None
    if now.point != FIRST_REQUEST or before.point != now.point:
        return None
    what = now.fault.one_line() if now.fault else "its log shows no memory failure"
    return (
        f"the engine died at its {now.point} twice in a row: {what} "
        "(not restarted again; see the failure events and the logs)"
    )


def _not_memory_reason(result: LaunchResult) -> str:
    if result.status == "timeout":
        return "the engine did not become healthy in time (not a memory failure: not retried)"
    if result.fault is not None:
        return (
            f"the engine failed during start-up: {result.fault.one_line()} (not retried; see "
            "the failure event and the log)"
        )
    return (
        f"the engine exited with code {result.returncode} before it was healthy, without a memory "
        "failure in its log (not retried; see the failure event and the log)"
    )


def default_log_dir() -> Path:
    """``$OOMGUARD_HOME/serve/<time>`` (default ``~/.cache/oomguard/serve/<time>``)."""
    base = os.environ.get("OOMGUARD_HOME")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "oomguard"
    return root / "serve" / time.strftime("%Y%m%d-%H%M%S")


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise :class:`BadInput` when something already listens on ``host:port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise BadInput(
                f"{what} {port} on {host} is in use ({exc.strerror or exc})",
                "stop what listens there or pick another port",
            ) from None


def check_model_path(model: str) -> None:
    """A model given as a path must exist (a hub id is left to the engine and the facts)."""
    from oomguard.facts.resolve import looks_like_path

    path = Path(model).expanduser()
    if not path.exists() and looks_like_path(model):
        raise BadInput(
            f"model path does not exist: {path}", "check the path to the model directory"
        )
