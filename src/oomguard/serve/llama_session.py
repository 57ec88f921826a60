"""``oomguard serve --engine llama.cpp``: plan the GPU/host split, launch llama-server, check
every buffer it prints against the prediction, heal an allocation failure by lowering the
split, supervise.

:class:`LlamaServeSession` is the llama.cpp side of :class:`oomguard.serve.loop.LaunchLoop`
(which owns the process, the kill on the failure line, the restarts with backoff and the clean
stop of the whole process group, with the same events and exit codes as for vLLM):

- the devices are the ones the binary offloads to (``llama-server --list-devices``: CUDA,
  ROCm, Vulkan or RPC devices, with their free memory now); none is a CPU-only run;
- the split is the largest that fits each device's free memory with llama.cpp's own 1 GiB
  margin (:func:`oomguard.tiering.split.best_split`) unless the command fixes one (``-ngl``,
  ``--n-cpu-moe``, ``-ot``);
- the prediction is every buffer llama-server prints at load, per device
  (:func:`oomguard.tiering.memory.predict_llama_cpp`); each printed buffer is an ``observed``
  event as its line appears, and the ``compare`` rows set predicted against printed;
- a buffer a device cannot allocate (``failed to allocate CUDA0 buffer of size N``) is healed
  by :func:`oomguard.tiering.split.after_allocation_failure`: at least one layer (or one
  layer's experts) fewer on the GPUs, the budget lowered by the shortfall, never a
  configuration already tried. A host buffer that cannot be allocated has no split to lower:
  serve stops and shows what else would serve.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from oomguard.errors import BadInput, OomguardError
from oomguard.logs import ParsedLog, Phase
from oomguard.logs.follow import Failure, LineNews
from oomguard.logs.parsed import Evidence, Observed
from oomguard.serve.events import EventHandler
from oomguard.serve.llama_command import LlamaCommand
from oomguard.serve.loop import (
    Launch,
    LaunchLoop,
    LaunchResult,
    LineSink,
    PhaseState,
    ServeOptions,
    check_port_free,
)
from oomguard.tiering.args import AUTO_SLOTS, FlagTable, LlamaArgs
from oomguard.tiering.compare import compare_load
from oomguard.tiering.gguf_file import read_gguf
from oomguard.tiering.loadlog import LoadLog
from oomguard.tiering.memory import LlamaCppMemory
from oomguard.tiering.model import GGUFModel
from oomguard.tiering.server import (
    LlamaDevice,
    find_llama_server,
    list_devices,
    llama_server_flags,
    llama_server_version,
)
from oomguard.tiering.split import SplitPlan, after_allocation_failure, best_split, price_split
from oomguard.units import GIB, MIB

LLAMA_PHASE_LABELS: dict[Phase, str] = {
    Phase.STARTUP: "starting",
    Phase.WEIGHT_LOADING: "loading weights",
    Phase.KV_ALLOCATION: "allocating the KV cache",
    Phase.SAMPLER_WARMUP: "reserving compute buffers, warming up",
    Phase.SERVING: "model loaded, starting the HTTP server",
}
# what llama-server prints as it loads, in order (tools/server, common, llama-model, llama-context)
_PHASE_LINES = (
    (re.compile(r"llama_server: initializing|system info:|build_info:"), Phase.STARTUP),
    (re.compile(r"load_model: loading model|llama_model_loader: loaded meta data|load_tensors:"),
     Phase.WEIGHT_LOADING),
    (re.compile(r"KV buffer size|llama_kv_cache:"), Phase.KV_ALLOCATION),
    (re.compile(r"compute buffer size|warming up the model"), Phase.SAMPLER_WARMUP),
    (re.compile(r"model loaded|listening on http"), Phase.SERVING),
)  # fmt: skip
_ALLOC_FAILED = re.compile(r"failed to allocate (?P<name>\S+) buffer of size (?P<bytes>\d+)")
# ggml-cuda.cu: "allocating %.2f MiB on device %d: cudaMalloc failed: …" (the line before
# the one above)
_DEVICE_MALLOC_FAILED = re.compile(
    r"allocating (?P<mib>[\d.]+) MiB on device (?P<device>\d+): (?P<api>cuda|hip)Malloc failed"
)
_ERROR_LINE = re.compile(r"^\S*\s+E\s|\berror\b", re.IGNORECASE)


# --- the engine --------------------------------------------------------------------------
class LlamaEngine:
    """A llama-server binary: its flags, its version, the devices it offloads to."""

    name = "llama.cpp"

    def __init__(self, binary: Path) -> None:
        self.binary = binary
        self.flags: FlagTable = llama_server_flags(binary)
        self.version = llama_server_version(binary)

    @classmethod
    def find(cls, binary: str | None = None) -> LlamaEngine:
        """The binary given, else ``$OOMGUARD_LLAMA_SERVER``, the cached build, ``PATH``."""
        if binary:
            path = Path(binary).expanduser()
            if not path.is_file():
                raise BadInput(
                    f"--llama-server {binary} is not a file", "point it at a llama-server binary"
                )
            return cls(path)
        return cls(find_llama_server())

    def argv(self, command: LlamaCommand) -> list[str]:
        """The process to start for ``command``."""
        return command.argv(str(self.binary))

    def environment(self, command: LlamaCommand) -> dict[str, str]:
        """This process's environment and the command's own assignments."""
        return {**os.environ, **command.env}

    def health_url(self, command: LlamaCommand) -> str:
        """llama-server's ``/health`` (503 while the model loads, 200 once it serves)."""
        return command.base_url + "/health"

    def new_reader(self) -> LlamaLogReader:
        """A fresh reader of llama-server's load log."""
        return LlamaLogReader()

    def devices(self, command: LlamaCommand) -> list[LlamaDevice]:
        """The devices ``command`` offloads to, with their memory now."""
        return list_devices(self.binary, command.rpc, command.devices)


# --- its log -------------------------------------------------------------------------------
@dataclass
class LlamaLogReader:
    """Reads llama-server's output as it is written: phases, each buffer, the allocation failure."""

    load_log: LoadLog = field(default_factory=LoadLog)
    lines: int = 0
    phases: dict[Phase, Evidence] = field(default_factory=dict)
    # (kind, device) → first line
    buffer_lines: dict[tuple[str, str], int] = field(default_factory=dict)
    errors: list[Evidence] = field(default_factory=list)
    failure: Failure | None = None
    failed_buffer: tuple[str, int] | None = None  # (buffer type, bytes) that could not be allocated
    _phase: Phase | None = None

    def feed(self, chunk: str) -> LineNews:
        """Take one line; return its phases, the buffer it printed, a failure."""
        news = LineNews()
        for line in chunk.splitlines() or [chunk]:
            self.lines += 1
            evidence = Evidence.of(self.lines, line)
            before = len(self.load_log.buffers)
            failures = len(self.load_log.failures)
            self.load_log.feed(line)
            for pattern, phase in _PHASE_LINES:
                if pattern.search(line) and phase not in self.phases:
                    self.phases[phase] = evidence
                    news.phases.append((phase, evidence))
                    self._phase = phase
            for buffer in self.load_log.buffers[before:]:
                key = (buffer.kind, buffer.device)
                self.buffer_lines.setdefault(key, self.lines)
                news.fields[f"{buffer.kind}_buffer_{buffer.device}"] = Observed(buffer, evidence)
            if len(self.load_log.failures) > failures and self.failure is None:
                self.failure = Failure("llama_alloc", evidence)
                news.failure = self.failure
                m = _ALLOC_FAILED.search(line)
                d = _DEVICE_MALLOC_FAILED.search(line)
                if m:
                    self.failed_buffer = (m.group("name"), int(m.group("bytes")))
                elif d:
                    prefix = "CUDA" if d.group("api") == "cuda" else "ROCm"
                    self.failed_buffer = (
                        f"{prefix}{d.group('device')}",
                        round(float(d.group("mib")) * MIB),
                    )
            elif _ERROR_LINE.search(line) and len(self.errors) < 5:
                self.errors.append(evidence)
        return news

    def parsed(self) -> ParsedLog:
        """What the loop reads of it: lines, phases, errors, the phase a failure happened in."""
        log = ParsedLog(lines=self.lines, phases=dict(self.phases), errors=list(self.errors))
        if self.failure is not None and self._phase is not None:
            log.failure_phase = Observed(self._phase, self.failure.evidence)
        return log


# --- the prediction --------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaPrediction:
    """The buffers llama-server will print, per device, against each device's free memory."""

    plan: SplitPlan
    devices: tuple[LlamaDevice, ...]

    @property
    def memory(self) -> LlamaCppMemory:
        """The buffers."""
        return self.plan.memory

    def problems(self) -> list[str]:
        """Why it may not load."""
        out = []
        if self.devices and not self.plan.fits_gpu:
            out.append(
                f"the fullest GPU needs {self.plan.gpu_need_bytes / GIB:.2f} GiB, over its "
                f"{self.plan.gpu_budget_bytes / GIB:.2f} GiB budget (free memory "
                "less a 1 GiB margin)"
            )
        if self.plan.fits_host is False:
            out.append(
                f"host memory: needs {self.plan.host_need_bytes / GIB:.2f} GiB, "
                f"{(self.plan.host_budget_bytes or 0) / GIB:.2f} GiB usable"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the buffers, per-device totals, the split and its budget."""
        m = self.memory
        devices = ["CPU", *m.gpu_devices()]
        return {
            "engine": "llama.cpp",
            "split": {
                "n_gpu_layers": m.settings.n_gpu_layers,
                "n_cpu_moe": m.settings.n_cpu_moe,
                "cpu_moe": m.settings.cpu_moe,
                "gpu_layers": m.placement.gpu_layers(),
                "layers": m.model.n_layer,
            },
            "context": {
                "n_ctx": m.context.n_ctx,
                "n_ctx_per_slot": m.context.n_ctx_seq,
                "slots": m.context.n_seq_max,
            },
            "buffers": [
                {
                    "kind": b.kind,
                    "device": b.device,
                    "name": b.name or b.device,
                    "mib": round(b.size_bytes / MIB, 2),
                    "low_mib": round(b.range_bytes()[0] / MIB, 2),
                    "high_mib": round(b.range_bytes()[1] / MIB, 2),
                    "estimated": b.estimated,
                }
                for b in m.buffers
            ],
            "per_device_gib": {d: round(m.device_bytes(d, "high") / GIB, 4) for d in devices},
            "gpu_budget_gib": round(self.plan.gpu_budget_bytes / GIB, 3) if self.devices else None,
            "fits": not self.problems(),
            "problems": self.problems(),
            "terms": {},
        }


def comparison_rows(memory: LlamaCppMemory, reader: LlamaLogReader) -> list[dict[str, Any]]:
    """Predicted against printed, one row per buffer kind and device that was printed, in the
    ``compare`` rows' shape (GiB; exact buffers agree to the print's 0.01 MiB, the compute
    buffer within its range)."""
    rows = []
    for check in compare_load(memory, reader.load_log):
        if check.observed_bytes is None:
            continue
        row: dict[str, Any] = {
            "term": f"{check.kind}_buffer_{check.device}",
            "label": f"{check.kind} buffer {check.device}",
            "unit": "GiB",
            "kind": check.kind,
            "device": check.device,
            "observed": round(check.observed_bytes / GIB, 9),
            "predicted": round(check.predicted_bytes / GIB, 9),
            "range": [round(check.low_bytes / GIB, 9), round(check.high_bytes / GIB, 9)],
            "diff": round((check.predicted_bytes - check.observed_bytes) / GIB, 9),
            "observed_bytes": check.observed_bytes,
            "predicted_bytes": check.predicted_bytes,
            "diff_pct": None
            if check.error_fraction is None
            else round(check.error_fraction * 100, 2),
            "in_range": check.agrees,
            "estimated": check.estimated,
            "line": reader.buffer_lines.get((check.kind, check.device)),
            "basis": "estimate (range)"
            if check.estimated
            else "exact (llama.cpp's allocation rules)",
        }
        rows.append(row)
    return rows


# --- the session -------------------------------------------------------------------------------
_Launch = Launch[LlamaCommand, LlamaPrediction]


class LlamaServeSession(LaunchLoop[LlamaCommand, LlamaPrediction, LlamaEngine]):
    """Serves a GGUF with llama-server (see the module docstring); :meth:`run` returns the exit
    code.

    ``options.command`` is a pasted llama-server command (its words after the binary, in a
    :class:`PastedLlamaCommand`), or ``options.model`` / ``options.gguf`` names the GGUF to plan
    for.
    """

    phase_labels = LLAMA_PHASE_LABELS

    def __init__(
        self,
        options: ServeOptions,
        *,
        handlers: list[EventHandler] | None = None,
        line_sink: LineSink | None = None,
        engine: LlamaEngine | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        pasted = options.command
        super().__init__(
            options, handlers=handlers, line_sink=line_sink, engine=engine, stop_event=stop_event
        )
        self.pasted: PastedLlamaCommand | None = (
            pasted if isinstance(pasted, PastedLlamaCommand) else None
        )
        self.command = None
        self.model: GGUFModel | None = None
        self.devices: list[LlamaDevice] = []
        self._read: LlamaArgs | None = None

    # --- preparation -------------------------------------------------------------------------
    def _prepare(self) -> None:
        if self.engine is None:
            binary = self.options.llama_server or (self.pasted.binary if self.pasted else None)
            self.engine = LlamaEngine.find(binary)
        command = self._read_command()
        try:
            self.model = read_gguf(command.model)
        except OomguardError:
            raise
        except Exception as exc:  # a file that is not a GGUF: gguf raises plain errors
            raise BadInput(
                f"{command.model} is not a readable GGUF file ({exc})", "pass a .gguf model file"
            ) from None
        self.devices = self.engine.devices(command)
        command = self._with_split(command)
        self.command = command
        check_port_free(command.bind_host, command.port, "llama-server's --port")
        if self.options.guard_port is not None:
            check_port_free("127.0.0.1", self.options.guard_port, "--guard-port")
        prediction = self._predict(command)
        device = (
            self.devices[0].to_dict() if self.devices else {"name": "CPU only", "free_gib": None}
        )
        self.events.emit(
            "plan",
            command=command.display(),
            engine=self.engine.name,
            engine_version=self.engine.version,
            device=device,
            devices=[d.to_dict() for d in self.devices],
            prediction=prediction.to_dict() if prediction else None,
            workload={
                "p99_tokens": self.options.workload.p99_tokens,
                "concurrency": self.options.workload.concurrency,
            },
        )

    def _read_command(self) -> LlamaCommand:
        """The pasted command, or one for ``oomguard serve MODEL.gguf`` with the workload's
        context and slots."""
        assert self.engine is not None
        o = self.options
        if self.pasted is not None:
            command, read = LlamaCommand.from_args(
                self.pasted.args, self.engine.flags, self.pasted.env, self.pasted.base_dir
            )
            for note in read.notes:
                self.events.emit("note", text=note)
            if read.fit:
                self.events.emit(
                    "note",
                    text="llama.cpp's own --fit is replaced by the planned split (--fit off)",
                )
            self._read = read
            return command
        gguf = o.gguf or (Path(o.model) if o.model else None)
        if gguf is None or not gguf.expanduser().is_file():
            raise BadInput(
                f"no GGUF file to serve with llama.cpp: {gguf}",
                "pass MODEL.gguf, or --gguf PATH beside a model id",
            )
        args = ["--model", str(gguf.expanduser().resolve()), *o.engine_args]
        w = o.workload
        if not _has_flag(o.engine_args, self.engine.flags, "--parallel"):
            args += ["--parallel", str(w.concurrency or AUTO_SLOTS)]
        if w.p99_tokens and not _has_flag(o.engine_args, self.engine.flags, "--ctx-size"):
            args += ["--ctx-size", str(w.p99_tokens * (w.concurrency or AUTO_SLOTS))]
        if o.host:
            args += ["--host", o.host]
        if o.port:
            args += ["--port", str(o.port)]
        command, read = LlamaCommand.from_args(args, self.engine.flags)
        for note in read.notes:
            self.events.emit("note", text=note)
        self._read = read
        return command

    def _with_split(self, command: LlamaCommand) -> LlamaCommand:
        """The command with the devices' count, and the largest split that fits unless it has
        one."""
        assert self.model is not None
        backend = self.devices[0].backend if self.devices else "cuda"
        assert self._read is not None
        settings = self._read.llama_settings(len(self.devices), backend)
        command = command.with_settings(settings)
        if not self.devices or command.explicit_split:
            return command
        found = best_split(self.model, settings, self._gpu_free_bytes(), 0, _host_total_bytes())
        self.events.emit(
            "note",
            text=f"planned split: {command.with_settings(found.settings).split_text()} "
            f"(the most that fits each device's free memory less a 1 GiB margin)",
        )
        return command.with_settings(found.settings)

    def _gpu_free_bytes(self) -> int:
        """The free memory of the emptiest-handed device (the split is sized per device)."""
        return min(d.free_bytes for d in self.devices)

    def _before_launch(self) -> None:
        if self.engine is not None and self.command is not None and self.devices:
            try:
                self.devices = self.engine.devices(self.command)
            except OomguardError:
                pass

    def _predict(self, command: LlamaCommand) -> LlamaPrediction | None:
        if self.model is None:
            return None
        try:
            free = self._gpu_free_bytes() if self.devices else 0
            plan = price_split(self.model, command.settings, free, 0, _host_total_bytes())
        except OomguardError as exc:
            self.events.emit("note", text=f"no prediction: {exc.one_line()}")
            return None
        return LlamaPrediction(plan, tuple(self.devices))

    # --- the log, against the prediction ---------------------------------------------------------
    def _report_news(self, launch: _Launch, state: PhaseState, news: LineNews) -> None:
        self._report_phases(launch, state, news)
        for name, obs in news.fields.items():
            buffer = obs.value
            self.events.emit(
                "observed",
                launch=launch.number,
                field=name,
                value=round(buffer.size_bytes / GIB, 9),
                unit="GiB",
                buffer=buffer.name,
                device=buffer.device,
                line=obs.evidence.line,
                text=obs.evidence.text,
            )

    def _comparison(self, launch: _Launch, parsed: ParsedLog) -> list[dict[str, Any]]:
        if launch.prediction is None:
            return []
        rows = comparison_rows(launch.prediction.memory, _reader(launch))
        return rows

    def _ready(self, launch: _Launch, state: PhaseState) -> None:
        for row in self._comparison(launch, launch.parsed()):
            self.events.emit("compare", launch=launch.number, **row)
        super()._ready(launch, state)

    # --- healing ----------------------------------------------------------------------------------
    def _heal(self, command: LlamaCommand, result: LaunchResult) -> LlamaCommand | None:
        assert self.model is not None
        launch = self.current
        failed = _reader(launch).failed_buffer if launch is not None else None
        cause = (
            f"llama-server could not allocate a {failed[0]} buffer of {failed[1] / MIB:.2f} MiB"
            if failed
            else "llama-server could not allocate a buffer"
        )
        if failed is None or not self.devices or _is_host_buffer(failed[0]):
            self._emit_heal(
                cause, "a host buffer: no split to lower (host memory is short)", None, []
            )
            return None
        self._before_launch()
        rejected: list[tuple[str, str]] = []
        settings = command.settings
        while True:
            plan = after_allocation_failure(self.model, settings, self._gpu_free_bytes(), failed[1])
            if plan is None:
                self._emit_heal(cause, "nothing left to move to the CPU", None, rejected)
                return None
            healed = command.with_settings(plan.settings)
            if healed.key() not in self.tried:
                self._emit_heal(
                    cause,
                    f"lower the split to {healed.split_text()}",
                    healed,
                    rejected,
                    was=command.split_text(),
                    plan=plan,
                )
                return healed
            rejected.append(
                (healed.split_text(), f"already tried (launch {self.tried[healed.key()]})")
            )
            settings = plan.settings

    def _emit_heal(
        self,
        cause: str,
        summary: str,
        healed: LlamaCommand | None,
        rejected: list[tuple[str, str]],
        was: str = "",
        plan: SplitPlan | None = None,
    ) -> None:
        data: dict[str, Any] = {
            "cause": cause,
            "summary": summary,
            "rejected": [{"change": c, "reason": r} for c, r in rejected],
        }
        if healed is not None:
            data.update(
                source="serve",
                change=f"{was} → {healed.split_text()}",
                command=healed.display(),
                changes={"split": healed.split_text()},
                why="the device had less room than predicted: its budget lowered by the shortfall, "
                "at least one layer fewer on it",
            )
            if plan is not None:
                data["prediction"] = LlamaPrediction(plan, tuple(self.devices)).to_dict()
        self.events.emit("heal", launch=len(self.launches), healed=healed is not None, **data)

    def _alternatives(self, command: LlamaCommand) -> None:
        """What would serve instead: a smaller KV cache, fewer slots, the CPU only (each priced)."""
        assert self.model is not None
        s = command.settings
        options: list[tuple[str, Any]] = []
        if s.cache_type_k == "f16":
            options.append(
                (
                    "q8_0 KV cache (half the KV memory)",
                    replace(s, cache_type_k="q8_0", cache_type_v="q8_0"),
                )
            )
        if s.parallel > 1:
            options.append(
                (
                    f"{s.parallel // 2} slots, half the context",
                    replace(s, parallel=max(1, s.parallel // 2), ctx_size=s.ctx_size // 2),
                )
            )
        if s.gpu_count:
            options.append(
                (
                    "the CPU only",
                    replace(
                        s,
                        gpu_count=0,
                        n_gpu_layers=0,
                        n_cpu_moe=0,
                        cpu_moe=False,
                        overrides=(),
                        tensor_split=(),
                    ),
                )
            )
        free = self._gpu_free_bytes() if self.devices else 0
        alternatives = []
        for rank, (title, settings) in enumerate(options, 1):
            plan = price_split(self.model, settings, free, 0, _host_total_bytes())
            alternatives.append(
                {
                    "rank": rank,
                    "kind": "llama_cpp",
                    "title": title,
                    "command": command.with_settings(settings).display(),
                    "gpu_gib_per_device": round(plan.gpu_need_bytes / GIB, 3),
                    "host_gib": round(plan.host_need_bytes / GIB, 3),
                }
            )
        self.events.emit(
            "alternatives", recommendation=None, alternatives=alternatives, command=None, fits=False
        )

    def _run_probes(self, launch: _Launch) -> None:
        """The longest request a slot holds, then the workload's concurrency of P99 requests."""
        from oomguard.serve.probe import probe_burst, probe_longest, served_model_name

        if launch.prediction is None or self.model is None:
            return
        base = launch.command.base_url
        per_slot = launch.prediction.memory.context.n_ctx_seq
        vocab = self.model.n_vocab
        try:
            model = served_model_name(base)
        except (OSError, ValueError, KeyError) as exc:
            self.events.emit("probe", probe="models", passed=False, error=str(exc))
            return
        self.events.emit(
            "probe", launch=launch.number, **probe_longest(base, model, per_slot, vocab).to_dict()
        )
        w = self.options.workload
        slots = launch.prediction.memory.context.n_seq_max
        length = min(w.p99_tokens or per_slot, per_slot)
        self.events.emit(
            "probe",
            launch=launch.number,
            **probe_burst(base, model, w.concurrency or slots, length, vocab).to_dict(),
        )

    def _guard_argv(self, command: LlamaCommand, port: int) -> list[str]:
        """The guard, told that the backend is llama-server and how its KV pool is laid out
        (``/props`` does not say whether the slots share one pool)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config = self.log_dir / "guard.yaml"
        backend = {
            "url": command.base_url,
            "engine": "llama.cpp",
            "kv_unified": command.settings.kv_unified,
        }
        config.write_text(yaml.safe_dump({"backends": [backend]}), encoding="utf-8")
        return [
            sys.executable,
            "-m",
            "oomguard.cli",
            "guard",
            "--config",
            str(config),
            "--port",
            str(port),
        ]


@dataclass(frozen=True)
class PastedLlamaCommand:
    """``oomguard serve -- llama-server …`` as typed: read once the binary's flags are known."""

    args: tuple[str, ...]
    binary: str | None = None  # the pasted binary when it is a path to a file
    env: dict[str, str] = field(default_factory=dict)
    base_dir: Path | None = None
    model: str = ""  # unused: the loop's options need one of command or model

    @classmethod
    def from_tokens(cls, words: list[str], base_dir: Path | None = None) -> PastedLlamaCommand:
        """``[VAR=x …] [path/]llama-server ARGS…``."""
        env: dict[str, str] = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            name, _, value = words[0].partition("=")
            env[name] = value
            words = words[1:]
        if not words or not is_llama_server(words[0]):
            raise BadInput(
                "the pasted command is not a llama-server command",
                "oomguard serve -- llama-server -m MODEL.gguf …",
            )
        first = Path(words[0]).expanduser()
        binary = str(first) if first.name != words[0] and first.is_file() else None
        return cls(tuple(words[1:]), binary, env, base_dir)


def is_llama_server(word: str) -> bool:
    """Whether ``word`` names llama-server (``llama-server``, ``./build/bin/llama-server``)."""
    return Path(word).name in ("llama-server", "llama-server.exe")


def _has_flag(args: tuple[str, ...], table: FlagTable, name: str) -> bool:
    wanted = table.canonical(name)
    return any(table.canonical(a.partition("=")[0]) == wanted for a in args if a.startswith("-"))


def _reader(launch: _Launch | None) -> LlamaLogReader:
    assert launch is not None and isinstance(launch.follower, LlamaLogReader)
    return launch.follower


def _is_host_buffer(name: str) -> bool:
    return name.startswith("CPU") or name.endswith("_Host")


def _host_total_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except (ImportError, OSError):
        return None
