"""``oomguard serve`` for vLLM: plan, launch, read, verify, heal, remember, supervise.

:class:`ServeSession` is the vLLM side of :class:`oomguard.serve.loop.LaunchLoop` (which owns
the process, the kill on a failure line, the restarts and the stop): it plans the command on
this machine's device, predicts vLLM's startup report, compares each number vLLM prints with
its prediction as the line appears (:mod:`oomguard.serve.verify`), heals a memory failure
with the first of the doctor's fixes it accepts (:mod:`oomguard.serve.heal`), stores the
observed terms in the calibration store and probes the ready server.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from oomguard.errors import OomguardError
from oomguard.logs import ParsedLog
from oomguard.logs.follow import LineNews
from oomguard.memory.spec import ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device, detect_device, refreshed
from oomguard.serve.engines import PHASE_LABELS, VllmEngine
from oomguard.serve.events import EventHandler
from oomguard.serve.heal import HealContext
from oomguard.serve.loop import (
    EXIT_NOT_STARTED,
    EXIT_STOPPED,
    Launch,
    LaunchLoop,
    LaunchResult,
    LineSink,
    PhaseState,
    ServeOptions,
    check_model_path,
    check_port_free,
)
from oomguard.serve.predict import Prediction, predict_command, resolve_spec
from oomguard.serve.verify import TERM_BY_FIELD, Comparison, compare
from oomguard.units import GIB

__all__ = ["EXIT_NOT_STARTED", "EXIT_STOPPED", "LaunchResult", "ServeOptions", "ServeSession"]

# numbers the log states that are shown as observed without a prediction of their own
_CONTEXT_FIELDS = ("gpu_total_gib", "startup_free_gib", "requested_gib", "gpu_blocks",
                   "estimated_max_model_len")  # fmt: skip
_Launch = Launch[EngineCommand, Prediction]


class ServeSession(LaunchLoop[EngineCommand, Prediction, VllmEngine]):
    """Serves a vLLM command (see the module docstring); :meth:`run` returns the exit code."""

    phase_labels = PHASE_LABELS

    def __init__(
        self,
        options: ServeOptions,
        *,
        handlers: list[EventHandler] | None = None,
        line_sink: LineSink | None = None,
        engine: VllmEngine | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        super().__init__(
            options, handlers=handlers, line_sink=line_sink, engine=engine, stop_event=stop_event
        )
        self.device: Device | None = None
        self.spec: ModelSpec | None = None

    # --- preparation ---------------------------------------------------------------------
    def _prepare(self) -> None:
        if self.engine is None:
            self.engine = VllmEngine.find(self.options.vllm_python)
        self.device = detect_device(self.engine.cpu_build)
        if self.command is None:
            self.command = self._planned_command()
        assert self.command is not None
        self.command.check()
        check_model_path(self.command.model)
        self.spec = self._resolve_spec(self.command)
        check_port_free(self.command.bind_host, self.command.port, "the engine's --port")
        if self.options.guard_port is not None:
            check_port_free("127.0.0.1", self.options.guard_port, "--guard-port")
        prediction = self._predict(self.command)
        self.events.emit(
            "plan",
            command=self.command.display(),
            engine=self.engine.name,
            engine_version=self.engine.version,
            device=self.device.to_dict() if self.device else None,
            prediction=prediction.to_dict() if prediction else None,
            workload={
                "p99_tokens": self.options.workload.p99_tokens,
                "concurrency": self.options.workload.concurrency,
            },
        )

    def _planned_command(self) -> EngineCommand:
        """``oomguard serve MODEL …``: plan on this machine's device, launch the result."""
        from oomguard.plan.service import plan

        o = self.options
        assert o.model is not None and self.engine is not None
        check_model_path(o.model)
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
            self.events.emit(
                "note",
                text="the plan predicts the recommended configuration does "
                "not fit; launching it to measure",
            )
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
        logs = [
            (launch.parsed(), launch.prediction.memory if launch.prediction else None)
            for launch in self.launches
        ]
        try:
            return predict_command(
                command,
                self.spec,
                self.device,
                self.engine.version,
                session_logs=logs,
                use_calibration=self.options.use_calibration,
                free_bytes=free_bytes,
            )
        except OomguardError as exc:
            self.events.emit("note", text=f"no prediction: {exc.one_line()}")
            return None

    def _before_launch(self) -> None:
        if self.device is not None:
            self.device = refreshed(self.device)

    # --- the log, against the prediction ---------------------------------------------------
    def _report_news(self, launch: _Launch, state: PhaseState, news: LineNews) -> None:
        self._report_phases(launch, state, news)
        terms = launch.prediction.terms if launch.prediction else None
        for name, obs in news.fields.items():
            term = TERM_BY_FIELD.get(name)
            if term is None and name not in _CONTEXT_FIELDS:
                continue
            self.events.emit(
                "observed",
                launch=launch.number,
                field=name,
                value=obs.value,
                line=obs.evidence.line,
                text=obs.evidence.text,
            )
            if term is not None and isinstance(obs.value, (int, float)):
                predicted = terms.get(term.name) if terms else None
                row = Comparison(term, float(obs.value), obs.evidence.line, predicted)
                self.events.emit("compare", launch=launch.number, **row.to_dict())

    def _comparison(self, launch: _Launch, parsed: ParsedLog) -> list[dict[str, Any]]:
        rows = compare(parsed, launch.prediction.terms if launch.prediction else None)
        return [r.to_dict() for r in rows]

    # --- healing -------------------------------------------------------------------------
    def _heal(self, command: EngineCommand, result: LaunchResult) -> EngineCommand | None:
        assert self.engine is not None
        if self.device is not None:
            self.device = refreshed(self.device)
        free = self.device.free_bytes if self.device is not None else None
        logs = [
            (launch.parsed(), launch.prediction.memory if launch.prediction else None)
            for launch in self.launches
        ]
        ctx = HealContext(
            parsed=result.parsed,
            failure=result.failure,
            command=command,
            tried=self.tried,
            spec=self.spec,
            device=self.device,
            vllm_version=self.engine.version,
            session_logs=logs,
            free_bytes=free,
            workload=self.options.workload,
            use_calibration=self.options.use_calibration,
            allow_precision_change=self.options.allow_precision_change,
        )
        decision = self.engine.heal(ctx)
        self.events.emit(
            "heal",
            launch=len(self.launches),
            healed=decision.command is not None,
            **decision.to_dict(),
        )
        return decision.command

    def _alternatives(self, command: EngineCommand) -> None:
        """What ``plan`` proposes instead (more GPUs, a quantized checkpoint, tiering)."""
        from oomguard.plan.service import plan

        if self.device is None or self.engine is None:
            return
        settings: dict[str, Any] = {"platform": self.device.platform}
        if self.engine.version not in ("", "unknown"):
            settings["vllm_version"] = self.engine.version
        import psutil

        w = self.options.workload
        # the fallback chain (tiering) checks its host-memory needs against this machine's RAM
        common = dict(
            gpu_count=self.device.count,
            concurrency=w.concurrency,
            allow_hub=self.options.allow_hub,
            use_calibration=self.options.use_calibration,
            host_memory_gib=psutil.virtual_memory().total / GIB,
        )
        length = command.parsed().settings_kwargs.get("max_model_len")
        try:
            # the command as given first; when its pinned settings leave plan nothing to change,
            # the model and the workload alone (the length the command asked for as the P99)
            data = plan(
                None,
                self.device.spec,
                command=["vllm", "serve", command.model, *command.args],
                p99_tokens=w.p99_tokens,
                **common,
                **settings,
            ).to_dict()  # type: ignore[arg-type]
            if not data.get("recommendation") and not data.get("alternatives"):
                p99 = w.p99_tokens or (length if length not in (None, -1) else None)
                data = plan(
                    command.model, self.device.spec, p99_tokens=p99, **common, **settings
                ).to_dict()  # type: ignore[arg-type]
        except OomguardError as exc:
            self.events.emit("note", text=f"plan has no alternatives: {exc.one_line()}")
            return
        self.events.emit(
            "alternatives",
            recommendation=data.get("recommendation"),
            alternatives=data.get("alternatives") or [],
            command=data.get("command"),
            fits=data.get("fits"),
        )

    # --- once ready ----------------------------------------------------------------------
    def _store_calibration(self, launch: _Launch) -> None:
        from oomguard.serve.calibrate import observation_of, store_observation

        if not self.options.calibrate or self.spec is None or self.device is None:
            return
        assert self.engine is not None
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        observation = observation_of(
            launch.parsed(),
            self.device,
            self.spec,
            self.engine.version,
            source=f"oomguard serve {stamp} launch {launch.number}",
            prediction=launch.prediction.memory if launch.prediction else None,
        )
        if observation is None:
            return
        try:
            key = store_observation(observation)
        except OomguardError as exc:
            self.events.emit("note", text=f"calibration not stored: {exc.one_line()}")
            return
        terms = {
            t: getattr(observation, f"{t}_gib")
            for t in ("weights", "activation", "non_torch", "cudagraph")
            if getattr(observation, f"{t}_gib") is not None
        }
        self.events.emit("calibration", key=key, terms=terms, source=observation.source)

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
            self.events.emit(
                "probe",
                launch=launch.number,
                **probe_longest(base, model, int(max_len), vocab).to_dict(),
            )
        w = self.options.workload
        if w.concurrency:
            length = min(w.p99_tokens or int(max_len or 1024), int(max_len or w.p99_tokens or 1024))
            self.events.emit(
                "probe",
                launch=launch.number,
                **probe_burst(base, model, w.concurrency, length, vocab).to_dict(),
            )
