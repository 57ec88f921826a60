"""One ``oomguard serve`` run: plan, launch, read, verify, heal, remember, supervise.

:class:`ServeSession` owns the engine process (through :class:`oomguard.engine.EngineProcess`),
reads its log as it is written (:class:`oomguard.logs.follow.LogFollower`), and reports
everything as :mod:`~oomguard.serve.events`. The loop:

1. launch the command; follow the log: phases, each stated number beside its prediction;
2. on a memory failure, SIGKILL the whole process group from the reader thread on the line
   that reports it, wait until the memory is back, and ask the heal for the next
   configuration; relaunch, at most ``max_attempts`` launches, never one twice;
3. when ``/health`` answers: store the observed terms, probe, start the guard;
4. supervise: a crash is restarted with backoff (a bounded number in a window), healed first
   when its log shows a memory failure; a stop request stops everything and checks that
   nothing of the engine is left.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

from oomguard.engine import (
    EngineLeftBehind,
    EngineProcess,
    Release,
    gpu_memory,
    http_ok,
    wait_memory_released,
)
from oomguard.errors import BadInput, OomguardError
from oomguard.logs import ParsedLog, Phase
from oomguard.logs.follow import Failure, LineNews, LogFollower
from oomguard.memory.spec import ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device, detect_device, refreshed
from oomguard.serve.engines import PHASE_LABELS, EngineKind, VllmEngine
from oomguard.serve.events import EventHandler, EventLog
from oomguard.serve.heal import HealContext, Workload
from oomguard.serve.predict import Prediction, predict_command, resolve_spec
from oomguard.serve.verify import TERM_BY_FIELD, Comparison, compare

GIB = 2**30
EXIT_STOPPED = 0
EXIT_NOT_STARTED = 1
# numbers the log states that are shown as observed without a prediction of their own
_CONTEXT_FIELDS = ("gpu_total_gib", "startup_free_gib", "requested_gib", "gpu_blocks",
                   "estimated_max_model_len")  # fmt: skip
LineSink = Any  # Callable[[str], None]


@dataclass
class ServeOptions:
    """How to serve: the command (or the model to plan for), the workload, the limits."""

    command: EngineCommand | None = None
    model: str | None = None  # plan first, then launch what the plan recommends
    plan_settings: dict[str, Any] = field(default_factory=dict)  # EngineSettings fields
    engine_args: tuple[str, ...] = ()  # extra vLLM flags for the planned command
    host: str | None = None
    port: int | None = None
    workload: Workload = field(default_factory=Workload)
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

    def validate(self) -> None:
        """Raise :class:`BadInput` for limits that make no sense."""
        if (self.command is None) == (self.model is None):
            raise BadInput("give either MODEL or a command after --",
                           "oomguard serve MODEL …  or  oomguard serve -- vllm serve MODEL …")  # fmt: skip
        if self.max_attempts < 1:
            raise BadInput(
                f"--max-attempts {self.max_attempts} must be at least 1", "pass 1 or more"
            )
        if self.max_restarts < 0 or self.restart_window_s <= 0:
            raise BadInput("--max-restarts must be 0 or more and --restart-window positive",
                           "e.g. --max-restarts 5 --restart-window 600")  # fmt: skip
        for name, port in (("--port", self.port), ("--guard-port", self.guard_port)):
            if port is not None and not 0 < port < 65536:
                raise BadInput(f"{name} {port} is not a port number", "pass 1-65535")


@dataclass
class LaunchResult:
    """How one launch ended."""

    status: str  # "ready" | "memory_failure" | "exited" | "stopped" | "timeout"
    parsed: ParsedLog
    failure: Failure | None = None
    returncode: int | None = None


@dataclass
class _Launch:
    """The engine process of one launch and what its reader thread shares."""

    number: int
    command: EngineCommand
    process: EngineProcess
    follower: LogFollower
    prediction: Prediction | None
    log_path: Path
    news: queue.Queue[tuple[float, LineNews]] = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    failure_read_at: float | None = None  # monotonic time the failure line was read
    killed_at: float | None = None  # monotonic time SIGKILL was sent to the group
    # each GPU's used memory before the launch (NVML), so the memory's return can be seen
    # where NVML lists no process of ours (containers)
    used_before: dict[int, int] | None = None

    def parsed(self) -> ParsedLog:
        """The launch's log so far (safe while the reader thread feeds it)."""
        with self.lock:
            return self.follower.parsed()

    def wait_released(self, pids: list[int]) -> Release:
        """Wait until the memory this launch's processes held is free again."""
        return wait_memory_released(pids, timeout_s=60.0, used_before_start=self.used_before)


class ServeSession:
    """Runs one serve (see the module docstring); :meth:`run` returns the exit code."""

    def __init__(
        self,
        options: ServeOptions,
        *,
        handlers: list[EventHandler] | None = None,
        line_sink: LineSink | None = None,
        engine: EngineKind | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        options.validate()
        self.options = options
        self.events = EventLog(handlers)
        self.line_sink = line_sink
        self.engine: EngineKind | None = engine
        self.device: Device | None = None
        self.spec: ModelSpec | None = None
        self.command: EngineCommand | None = options.command
        self.stop_requested = stop_event or threading.Event()
        self.launches: list[_Launch] = []
        self.tried: dict[str, int] = {}
        self.current: _Launch | None = None
        self.guard: EngineProcess | None = None
        self.log_dir = options.log_dir or _default_log_dir()
        self._probed: set[str] = set()

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

    # --- preparation ---------------------------------------------------------------------
    def _prepare(self) -> None:
        if self.engine is None:
            self.engine = VllmEngine.find(self.options.vllm_python)
        self.device = detect_device(self.engine.cpu_build)
        if self.command is None:
            self.command = self._planned_command()
        assert self.command is not None
        self.command.check()
        _check_model_path(self.command.model)
        self.spec = self._resolve_spec(self.command)
        _check_port_free(self.command.bind_host, self.command.port, "the engine's --port")
        if self.options.guard_port is not None:
            _check_port_free("127.0.0.1", self.options.guard_port, "--guard-port")
        prediction = self._predict(self.command)
        self.events.emit(
            "plan",
            command=self.command.display(),
            engine=self.engine.name,
            engine_version=self.engine.version,
            device=self.device.to_dict() if self.device else None,
            prediction=prediction.to_dict() if prediction else None,
            workload={"p99_tokens": self.options.workload.p99_tokens,
                      "concurrency": self.options.workload.concurrency},
        )  # fmt: skip

    def _planned_command(self) -> EngineCommand:
        """``oomguard serve MODEL …``: plan on this machine's device, launch the result."""
        from oomguard.api import plan

        o = self.options
        assert o.model is not None and self.engine is not None
        _check_model_path(o.model)
        settings = dict(o.plan_settings)
        if self.device is not None:
            settings["platform"] = self.device.platform
        if self.engine.version not in ("", "unknown"):
            settings.setdefault("vllm_version", self.engine.version)
        result = plan(
            o.model,
            self.device.spec if self.device else None,
            gpu_count=self.device.count if self.device else None,
            p99_tokens=o.workload.p99_tokens,
            concurrency=o.workload.concurrency,
            allow_hub=o.allow_hub,
            use_calibration=o.use_calibration,
            **settings,
        )
        if not result.plan.fits:
            self.events.emit("note", text="the plan predicts the recommended configuration does "
                             "not fit; launching it to measure")  # fmt: skip
        tokens = result.plan.commands()["vllm_serve"]
        command = EngineCommand.from_tokens([tokens])
        extra = list(o.engine_args)
        if o.host is not None:
            extra += ["--host", o.host]
        if o.port is not None:
            extra += ["--port", str(o.port)]
        return EngineCommand.from_tokens(["vllm", "serve", command.model, *command.args, *extra])

    def _resolve_spec(self, command: EngineCommand) -> ModelSpec | None:
        try:
            quantization = command.parsed().settings_kwargs.get("quantization")
            return resolve_spec(command.model, quantization, allow_hub=self.options.allow_hub)
        except OomguardError as exc:
            self.events.emit("note", text=f"no prediction: {exc.one_line()}")
            return None

    def _predict(self, command: EngineCommand, free_bytes: int | None = None) -> Prediction | None:
        if self.spec is None or self.device is None or self.engine is None:
            return None
        logs = [(launch.parsed(), launch.prediction.memory if launch.prediction else None)
                for launch in self.launches]  # fmt: skip
        try:
            return predict_command(
                command, self.spec, self.device, self.engine.version, session_logs=logs,
                use_calibration=self.options.use_calibration, free_bytes=free_bytes,
            )  # fmt: skip
        except OomguardError as exc:
            self.events.emit("note", text=f"no prediction: {exc.one_line()}")
            return None

    # --- the serve loop ------------------------------------------------------------------
    def _serve(self) -> tuple[int, str]:
        restarts: deque[float] = deque()
        assert self.command is not None
        command = self.command
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

    def _start(self, command: EngineCommand) -> EngineCommand | str | None:
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
    def _launch(self, command: EngineCommand, attempt: int) -> LaunchResult:
        assert self.engine is not None
        number = len(self.launches) + 1
        if self.device is not None:
            self.device = refreshed(self.device)
        prediction = self._predict(command)
        log_path = self.log_dir / f"launch-{number}.log"
        process = EngineProcess(
            self.engine.argv(command), env=self.engine.environment(command), log_path=log_path
        )
        launch = _Launch(number, command, process, self.engine.new_reader(), prediction, log_path)
        process.add_line_callback(lambda line: self._on_line(launch, line))
        self.launches.append(launch)
        self.tried.setdefault(command.key(), number)
        self.current = launch
        devices = gpu_memory()
        launch.used_before = {d.index: d.used_bytes for d in devices} if devices else None
        launch.process.start()
        self.events.emit(
            "launch", number=number, attempt=attempt, max_attempts=self.options.max_attempts,
            command=command.display(), argv=launch.process.argv, pid=launch.process.pid,
            log=str(log_path), prediction=prediction.to_dict() if prediction else None,
        )  # fmt: skip
        return self._follow(launch)

    def _on_line(self, launch: _Launch, line: str) -> None:
        """Reader thread: parse the line; on a memory failure kill the group at once."""
        read_at = time.monotonic()
        with launch.lock:
            news = launch.follower.feed(line)
        if news.failure is not None and launch.killed_at is None:
            launch.failure_read_at = read_at
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(launch.process.pid, signal.SIGKILL)
            launch.killed_at = time.monotonic()
        if self.line_sink is not None:
            self.line_sink(line)
        if not news.empty:
            launch.news.put((read_at, news))

    def _follow(self, launch: _Launch) -> LaunchResult:
        """Wait for the launch to become healthy, fail, exit, time out or be stopped."""
        assert self.engine is not None
        health = self.engine.health_url(launch.command)
        state = _PhaseState()
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
                self.events.emit("failure", kind="timeout", launch=launch.number,
                                 text=f"not healthy after {self.options.startup_timeout_s:g} s")  # fmt: skip
                return LaunchResult("timeout", launch.parsed())

    def _drain(self, launch: _Launch, state: _PhaseState, timeout_s: float) -> None:
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

    def _report_news(self, launch: _Launch, state: _PhaseState, news: LineNews) -> None:
        for phase, evidence in news.phases:
            if state.advance(phase):
                self.events.emit("phase", launch=launch.number, phase=phase.value,
                                 label=PHASE_LABELS.get(phase, phase.value), line=evidence.line)  # fmt: skip
        terms = launch.prediction.terms if launch.prediction else None
        for name, obs in news.fields.items():
            term = TERM_BY_FIELD.get(name)
            if term is None and name not in _CONTEXT_FIELDS:
                continue
            self.events.emit("observed", launch=launch.number, field=name, value=obs.value,
                             line=obs.evidence.line, text=obs.evidence.text)  # fmt: skip
            if term is not None and isinstance(obs.value, (int, float)):
                predicted = terms.get(term.name) if terms else None
                row = Comparison(term, float(obs.value), obs.evidence.line, predicted)
                self.events.emit("compare", launch=launch.number, **row.to_dict())

    # --- outcomes of a launch ------------------------------------------------------------
    def _failed(self, launch: _Launch, state: _PhaseState) -> LaunchResult:
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
            "failure", kind="memory", launch=launch.number, signature=failure.signature,
            line=failure.evidence.line, text=failure.evidence.text,
            phase=parsed.failure_phase.value.value if parsed.failure_phase else None,
            line_to_kill_s=round((launch.killed_at or gone_at) - launch.failure_read_at, 4),
            line_to_gone_s=round(gone_at - launch.failure_read_at, 4),
            memory_released=release.released, release_source=release.source,
            release_wait_s=round(release.waited_s, 3), log=str(launch.log_path),
            comparison=[c.to_dict() for c in self._comparison(launch, parsed)],
        )  # fmt: skip
        return LaunchResult("memory_failure", parsed, failure, launch.process.returncode)

    def _exited(self, launch: _Launch, state: _PhaseState) -> LaunchResult:
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
        errors = [e.text for e in parsed.errors[:3]] or launch.process.tail(5)
        self.events.emit(
            "failure", kind="memory" if memory else "exited", launch=launch.number,
            returncode=code, signature=failure.signature if failure else None,
            line=failure.evidence.line if failure else None,
            text=failure.evidence.text if failure else " | ".join(errors)[:800],
            log=str(launch.log_path),
        )  # fmt: skip
        return LaunchResult("memory_failure" if memory else "exited", parsed, failure, code)

    def _ready(self, launch: _Launch, state: _PhaseState) -> None:
        parsed = launch.parsed()
        rows = self._comparison(launch, parsed)
        self.events.emit(
            "ready", launch=launch.number, url=launch.command.base_url,
            command=launch.command.display(), pid=launch.process.pid,
            startup_s=round(launch.process.elapsed_s(), 2),
            comparison=[r.to_dict() for r in rows],
        )  # fmt: skip

    def _comparison(self, launch: _Launch, parsed: ParsedLog) -> list[Comparison]:
        return compare(parsed, launch.prediction.terms if launch.prediction else None)

    # --- healing -------------------------------------------------------------------------
    def _heal(self, command: EngineCommand, result: LaunchResult) -> EngineCommand | None:
        assert self.engine is not None
        if self.device is not None:
            self.device = refreshed(self.device)
        free = self.device.free_bytes if self.device is not None else None
        logs = [(launch.parsed(), launch.prediction.memory if launch.prediction else None)
                for launch in self.launches]  # fmt: skip
        ctx = HealContext(
            parsed=result.parsed, failure=result.failure, command=command, tried=self.tried,
            spec=self.spec, device=self.device, vllm_version=self.engine.version,
            session_logs=logs, free_bytes=free, workload=self.options.workload,
            use_calibration=self.options.use_calibration,
            allow_precision_change=self.options.allow_precision_change,
        )  # fmt: skip
        decision = self.engine.heal(ctx)
        self.events.emit("heal", launch=len(self.launches), healed=decision.command is not None,
                         **decision.to_dict())  # fmt: skip
        return decision.command

    def _alternatives(self, command: EngineCommand) -> None:
        """What ``plan`` proposes instead (more GPUs, a quantized checkpoint, tiering)."""
        from oomguard.api import plan

        if self.device is None or self.engine is None:
            return
        settings: dict[str, Any] = {"platform": self.device.platform}
        if self.engine.version not in ("", "unknown"):
            settings["vllm_version"] = self.engine.version
        import psutil

        w = self.options.workload
        # the fallback chain (tiering) checks its host-memory needs against this machine's RAM
        common = dict(gpu_count=self.device.count, concurrency=w.concurrency,
                      allow_hub=self.options.allow_hub, use_calibration=self.options.use_calibration,
                      host_memory_gib=psutil.virtual_memory().total / GIB)  # fmt: skip
        length = command.parsed().settings_kwargs.get("max_model_len")
        try:
            # the command as given first; when its pinned settings leave plan nothing to change,
            # the model and the workload alone (the length the command asked for as the P99)
            data = plan(None, self.device.spec, command=["vllm", "serve", command.model, *command.args],
                        p99_tokens=w.p99_tokens, **common, **settings).to_dict()  # type: ignore[arg-type]  # fmt: skip
            if not data.get("recommendation") and not data.get("alternatives"):
                p99 = w.p99_tokens or (length if length not in (None, -1) else None)
                data = plan(command.model, self.device.spec, p99_tokens=p99,
                            **common, **settings).to_dict()  # type: ignore[arg-type]  # fmt: skip
        except OomguardError as exc:
            self.events.emit("note", text=f"plan has no alternatives: {exc.one_line()}")
            return
        self.events.emit("alternatives", recommendation=data.get("recommendation"),
                         alternatives=data.get("alternatives") or [],
                         command=data.get("command"), fits=data.get("fits"))  # fmt: skip

    # --- once ready ----------------------------------------------------------------------
    def _after_ready(self, command: EngineCommand) -> bool:
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

    def _store_calibration(self, launch: _Launch) -> None:
        from oomguard.serve.calibrate import observation_of, store_observation

        if not self.options.calibrate or self.spec is None or self.device is None:
            return
        assert self.engine is not None
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        observation = observation_of(
            launch.parsed(), self.device, self.spec, self.engine.version,
            source=f"oomguard serve {stamp} launch {launch.number}",
            prediction=launch.prediction.memory if launch.prediction else None,
        )  # fmt: skip
        if observation is None:
            return
        try:
            key = store_observation(observation)
        except OomguardError as exc:
            self.events.emit("note", text=f"calibration not stored: {exc.one_line()}")
            return
        terms = {t: getattr(observation, f"{t}_gib") for t in
                 ("weights", "activation", "non_torch", "cudagraph")
                 if getattr(observation, f"{t}_gib") is not None}  # fmt: skip
        self.events.emit("calibration", key=key, terms=terms, source=observation.source)

    def _probe_enabled(self) -> bool:
        if self.options.probe is not None:
            return self.options.probe
        w = self.options.workload
        return w.p99_tokens is not None or w.concurrency is not None

    def _run_probes(self, launch: _Launch) -> None:
        from oomguard.serve.probe import probe_burst, probe_longest, served_model_name

        base = launch.command.base_url
        settings = launch.prediction.memory.settings if launch.prediction else None
        max_len = launch.parsed().get("max_model_len") or (
            settings.max_model_len if settings else None
        )
        vocab = self.spec.vocab_size if self.spec else 32000
        try:
            model = served_model_name(base)
        except (OSError, ValueError, KeyError) as exc:
            self.events.emit("probe", probe="models", passed=False, error=str(exc))
            return
        if max_len:
            self.events.emit("probe", launch=launch.number,
                             **probe_longest(base, model, int(max_len), vocab).to_dict())  # fmt: skip
        w = self.options.workload
        if w.concurrency:
            length = min(w.p99_tokens or int(max_len or 1024), int(max_len or w.p99_tokens or 1024))
            self.events.emit("probe", launch=launch.number,
                             **probe_burst(base, model, w.concurrency, length, vocab).to_dict())  # fmt: skip

    def _start_guard(self, command: EngineCommand) -> None:
        port = self.options.guard_port
        assert port is not None
        argv = [sys.executable, "-m", "oomguard.cli", "guard", "--backend", command.base_url,
                "--port", str(port)]  # fmt: skip
        log_path = self.log_dir / "guard.log"
        guard = EngineProcess(argv, log_path=log_path)
        guard.start()
        self.guard = guard
        url = f"http://127.0.0.1:{port}"
        healthy = guard.wait_healthy(url + "/health", timeout_s=60.0)
        self.events.emit("guard", url=url, pid=guard.pid, healthy=healthy, backend=command.base_url,
                         log=str(log_path), tail=[] if healthy else guard.tail(5))  # fmt: skip

    # --- supervision ---------------------------------------------------------------------
    def _supervise(self) -> LaunchResult | None:
        """Wait while the engine serves; the crash, or None when a stop was requested."""
        launch = self.current
        assert launch is not None
        state = _PhaseState(Phase.SERVING)
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
            parsed = launch.parsed()
            failure = launch.follower.failure
            self.events.emit(
                "failure", kind="memory" if failure else "crash", launch=launch.number,
                returncode=launch.process.returncode,
                signature=failure.signature if failure else None,
                line=failure.evidence.line if failure else None,
                text=failure.evidence.text if failure else " | ".join(launch.process.tail(3))[:800],
                log=str(launch.log_path),
            )  # fmt: skip
            return LaunchResult("memory_failure" if failure else "exited", parsed, failure)
        return None

    def _after_crash(
        self, command: EngineCommand, crashed: LaunchResult, backoff_s: float
    ) -> EngineCommand:
        """Wait the backoff; heal first when the crash was a memory failure."""
        new = command
        if crashed.status == "memory_failure":
            healed = self._heal(command, crashed)
            new = healed or command
        self.events.emit("restart", after_s=backoff_s, command=new.display(),
                         healed=new is not command)  # fmt: skip
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


class _PhaseState:
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


def _not_memory_reason(result: LaunchResult) -> str:
    if result.status == "timeout":
        return "the engine did not become healthy in time (not a memory failure: not retried)"
    return (
        f"the engine exited with code {result.returncode} before it was healthy, without a memory "
        "failure in its log (not retried; see the failure event and the log)"
    )


def _default_log_dir() -> Path:
    base = os.environ.get("OOMGUARD_HOME")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "oomguard"
    return root / "serve" / time.strftime("%Y%m%d-%H%M%S")


def _check_model_path(model: str) -> None:
    """A model given as a path must exist (a hub id is left to vLLM and the facts)."""
    from oomguard.facts.resolve import _looks_like_path

    path = Path(model).expanduser()
    if not path.exists() and _looks_like_path(model):
        raise BadInput(
            f"model path does not exist: {path}", "check the path to the model directory"
        )


def _check_port_free(host: str, port: int, what: str) -> None:
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
