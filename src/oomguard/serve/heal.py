"""The next configuration after a memory failure: the doctor's fix, checked, or serve's own.

The doctor diagnoses the failed launch's log and proposes fixes (its first finding's, in its
order). serve runs a fix only when all of these hold:

- it is a flag or an environment variable (an action for a person is not runnable);
- the configuration it gives was not launched before in this session;
- a changed utilization leaves a margin below the memory free now: ``util × total`` at most
  free − max(2 % of total, 256 MiB), never free ÷ total itself;
- it keeps the stated workload: ``--max-model-len`` not below the P99, ``--max-num-seqs``
  not below the concurrency;
- it keeps the model's numerics (``--quantization``, ``--kv-cache-dtype``, ``--dtype``)
  unless the user allowed a precision change;
- the memory model, with the terms this session measured, predicts the start succeeds.

When no fix of the doctor passes, serve computes candidates itself from the log's numbers and
the memory model (:func:`_own_candidates`), under the same checks. Every rejected candidate is
kept with its reason, so the report says why nothing was tried.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from oomguard.logs import ParsedLog, Phase
from oomguard.logs.follow import Failure
from oomguard.memory.engine import MemoryPrediction
from oomguard.memory.spec import ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device
from oomguard.serve.predict import Prediction, predict_command

GIB = 2**30
MIB = 2**20
UTIL_MARGIN_FRACTION = 0.02
UTIL_MARGIN_MIN_BYTES = 256 * MIB
KV_MARGIN = 0.10  # spare KV capacity a computed pool size keeps (plan's default margin)
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# settings whose change changes the model's numbers, not only its memory
_PRECISION_SETTINGS = ("quantization", "kv_cache_dtype", "dtype")


@dataclass(frozen=True)
class Workload:
    """What the server must keep serving whatever the heal changes."""

    p99_tokens: int | None = None
    concurrency: int | None = None


@dataclass(frozen=True)
class Candidate:
    """One change to try: flags (and environment) with values, why, and who proposed it."""

    changes: dict[str, str | None]
    why: str
    source: str  # "doctor" | "serve"

    @property
    def text(self) -> str:
        """The change as the user would type it."""
        parts = []
        for flag, value in self.changes.items():
            if flag.startswith("--"):
                parts.append(flag if value is None else f"{flag} {value}")
            else:
                parts.append(f"{flag}={value}")
        return " ".join(parts)


@dataclass
class HealDecision:
    """The outcome: the next command (None when none passes), why, and what was refused."""

    cause: str
    summary: str
    command: EngineCommand | None = None
    candidate: Candidate | None = None
    prediction: Prediction | None = None
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (change, reason)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the ``heal`` event's payload)."""
        out: dict[str, Any] = {
            "cause": self.cause,
            "summary": self.summary,
            "rejected": [{"change": c, "reason": r} for c, r in self.rejected],
        }
        if self.candidate is not None:
            out.update(
                source=self.candidate.source,
                changes=self.candidate.changes,
                change=self.candidate.text,
                why=self.candidate.why,
            )
        if self.command is not None:
            out["command"] = self.command.display()
        if self.prediction is not None:
            out["prediction"] = self.prediction.to_dict()
        return out


@dataclass
class HealContext:
    """Everything a heal decision reads."""

    parsed: ParsedLog
    failure: Failure | None
    command: EngineCommand
    tried: dict[str, int]  # configuration key → launch number
    spec: ModelSpec | None
    device: Device | None
    vllm_version: str
    session_logs: list[tuple[ParsedLog, MemoryPrediction | None]]
    free_bytes: int | None  # measured after the failed engine's memory came back
    workload: Workload = field(default_factory=Workload)
    use_calibration: bool = True
    allow_precision_change: bool = False


def decide(ctx: HealContext) -> HealDecision:
    """The next configuration after the failure in ``ctx.parsed`` (see the module docstring)."""
    from oomguard.doctor.diagnose import diagnose
    from oomguard.doctor.situation import Context

    diagnosis = diagnose(
        ctx.parsed, Context(model=ctx.command.model, command=ctx.command.display())
    )
    top = diagnosis.findings[0] if diagnosis.findings else None
    decision = HealDecision(
        cause=top.cause if top else "unknown",
        summary=top.summary if top else "the log shows a memory failure the doctor cannot place",
    )
    doctor = [_doctor_candidate(fix) for fix in (top.ordered_fixes() if top else [])]
    for candidate in [c for c in doctor if c is not None]:
        if _accept(ctx, candidate, decision):
            return decision
    for fix in top.ordered_fixes() if top else []:
        if _doctor_candidate(fix) is None:
            decision.rejected.append((fix.as_text, "not a flag or environment variable to set"))
    for candidate in _own_candidates(ctx):
        if _accept(ctx, candidate, decision):
            return decision
    return decision


def _doctor_candidate(fix: Any) -> Candidate | None:
    flag = str(fix.flag)
    if flag.startswith("--"):
        # The fix's flag with its companions (``also``): they are one change.
        changes = {
            name: None if value in (None, "") else str(value) for name, value in fix.flags().items()
        }
        return Candidate(changes, fix.why, "doctor")
    if _ENV_NAME.fullmatch(flag) and fix.value is not None:
        return Candidate({flag: str(fix.value)}, fix.why, "doctor")
    return None


def apply(command: EngineCommand, candidate: Candidate) -> EngineCommand:
    """``command`` with the candidate's flags and environment applied."""
    from dataclasses import replace

    for name, value in candidate.changes.items():
        if name.startswith("--"):
            command = command.with_flag(name, value)
        else:
            command = replace(command, env={**command.env, name: str(value)})
    return command


def _accept(ctx: HealContext, candidate: Candidate, decision: HealDecision) -> bool:
    """Check ``candidate``; on success fill ``decision`` and return True, else note why not."""
    try:
        new = apply(ctx.command, candidate)
        key = new.key()
    except Exception as exc:  # noqa: BLE001 - a fix the command reader refuses is not runnable
        decision.rejected.append((candidate.text, f"not a valid vLLM setting ({exc})"))
        return False
    if key in ctx.tried:
        decision.rejected.append((candidate.text, f"same configuration as launch {ctx.tried[key]}"))
        return False
    reason = (
        _precision_problem(ctx, new)
        or _margin_problem(ctx, new)
        or _workload_problem(ctx, new)
        or _parallel_problem(ctx, new)
    )
    if reason:
        decision.rejected.append((candidate.text, reason))
        return False
    prediction = _predict(ctx, new)
    reason = _pool_problem(ctx, new, prediction)
    if reason:
        decision.rejected.append((candidate.text, reason))
        return False
    if prediction is not None and not prediction.fits:
        problem = prediction.problems[0] if prediction.problems else "does not fit"
        decision.rejected.append(
            (candidate.text, f"the memory model predicts it still fails: {problem}")
        )
        return False
    decision.command, decision.candidate, decision.prediction = new, candidate, prediction
    return True


def _predict(ctx: HealContext, command: EngineCommand) -> Prediction | None:
    if ctx.spec is None or ctx.device is None:
        return None
    try:
        return predict_command(
            command,
            ctx.spec,
            ctx.device,
            ctx.vllm_version,
            session_logs=ctx.session_logs,
            use_calibration=ctx.use_calibration,
            free_bytes=ctx.free_bytes,
        )
    except Exception:  # noqa: BLE001 - the model cannot price it: the margin checks still hold
        return None


def util_margin_bytes(total_bytes: int) -> int:
    """The memory a utilization must leave free: 2 % of the device, at least 256 MiB."""
    return max(int(UTIL_MARGIN_FRACTION * total_bytes), UTIL_MARGIN_MIN_BYTES)


def _total_bytes(ctx: HealContext) -> int | None:
    stated = ctx.parsed.get("startup_total_gib") or ctx.parsed.get("gpu_total_gib")
    if stated:
        return int(float(stated) * GIB)
    return ctx.device.spec.total_bytes if ctx.device is not None else None


def _free_bytes(ctx: HealContext) -> int | None:
    values = [ctx.free_bytes] if ctx.free_bytes is not None else []
    logged = ctx.parsed.get("startup_free_gib")
    if logged is not None:
        values.append(int(float(logged) * GIB))
    return min(values) if values else None


def _margin_problem(ctx: HealContext, new: EngineCommand) -> str | None:
    """A changed utilization must leave the margin below the free memory."""
    before = ctx.command.parsed().settings_kwargs.get("gpu_memory_utilization")
    util = new.parsed().settings_kwargs.get("gpu_memory_utilization")
    if util is None or util == before:
        return None
    total, free = _total_bytes(ctx), _free_bytes(ctx)
    if total is None or free is None:
        return None
    margin = util_margin_bytes(total)
    if util * total > free - margin:
        return (
            f"utilization {util:g} asks {util * total / GIB:.2f} GiB; {free / GIB:.2f} GiB are free "
            f"and {margin / GIB:.2f} GiB must stay free"
        )
    return None


def _pool_problem(ctx: HealContext, new: EngineCommand, prediction: Prediction | None) -> str | None:
    """A larger explicit pool (``--kv-cache-memory-bytes``) is allocated whatever the
    utilization: the engine's predicted non-KV memory (at the top of its range) and the new
    pool must fit in the memory free now, with the margin."""
    before = ctx.command.parsed().settings_kwargs.get("kv_cache_memory_bytes")
    pool = new.parsed().settings_kwargs.get("kv_cache_memory_bytes")
    if pool is None or (before is not None and int(pool) <= int(before)):
        return None
    free, total = _free_bytes(ctx), _total_bytes(ctx)
    if free is None or total is None:
        return None
    non_kv = 0
    if prediction is not None:
        m = prediction.memory
        non_kv = sum(e.high_bytes for e in (m.weights, m.activation, m.non_torch, m.cudagraph))
    margin = util_margin_bytes(total)
    if int(pool) + non_kv > free - margin:
        return (
            f"a pool of {int(pool) / GIB:.3f} GiB and {non_kv / GIB:.2f} GiB beside it need more than "
            f"the {free / GIB:.2f} GiB free less the {margin / GIB:.2f} GiB margin"
        )
    return None


def _precision_problem(ctx: HealContext, new: EngineCommand) -> str | None:
    if ctx.allow_precision_change:
        return None
    before, after = ctx.command.parsed().settings_kwargs, new.parsed().settings_kwargs
    changed = [n for n in _PRECISION_SETTINGS if before.get(n) != after.get(n)]
    if changed:
        flags = ", ".join("--" + n.replace("_", "-") for n in changed)
        return f"{flags} changes the model's numerics (pass --allow-precision-change to allow it)"
    return None


def _workload_problem(ctx: HealContext, new: EngineCommand) -> str | None:
    settings = new.parsed().settings_kwargs
    length, seqs = settings.get("max_model_len"), settings.get("max_num_seqs")
    w = ctx.workload
    if w.p99_tokens and length not in (None, -1) and int(length) < w.p99_tokens:
        return f"max_model_len {length} is below the workload's P99 of {w.p99_tokens} tokens"
    if w.concurrency and seqs is not None and int(seqs) < w.concurrency:
        return f"max_num_seqs {seqs} is below the workload's concurrency of {w.concurrency}"
    return None


def _parallel_problem(ctx: HealContext, new: EngineCommand) -> str | None:
    settings = new.parsed().settings_kwargs
    world = int(settings.get("tensor_parallel_size") or 1) * int(
        settings.get("pipeline_parallel_size") or 1
    )
    count = ctx.device.count if ctx.device is not None else 1
    if world > count:
        return f"needs {world} GPUs; this machine has {count}"
    return None


# --- serve's own candidates -----------------------------------------------------------------


def _own_candidates(ctx: HealContext) -> list[Candidate]:
    """Next configurations computed from the log's numbers and the memory model."""
    current = _predict(ctx, ctx.command)
    signature = ctx.failure.signature if ctx.failure else ""
    phase = ctx.parsed.failure_phase.value if ctx.parsed.failure_phase else None
    if signature == "startup_check_failed":
        return _util_to_free(ctx)
    if signature in (
        "kv_too_small",
        "no_cache_blocks",
        "cpu_kv_allocation_failed",
        "auto_fit_failed",
    ):
        return _kv_candidates(ctx, current)
    if phase == Phase.CUDA_GRAPH_CAPTURE:
        return [*_util_to_free(ctx, extra_bytes=_graph_bytes(ctx, current)),
                Candidate({"--enforce-eager": None}, "no CUDA graphs to capture", "serve")]  # fmt: skip
    if phase in (Phase.PROFILING, Phase.SAMPLER_WARMUP, Phase.SERVING):
        return _batch_candidates(ctx, current)
    if phase == Phase.WEIGHT_LOADING:
        return _tp_candidates(ctx)
    return [*_batch_candidates(ctx, current), *_kv_candidates(ctx, current)]


def _setting(ctx: HealContext, name: str) -> Any:
    return ctx.command.parsed().settings_kwargs.get(name)


def _util_to_free(ctx: HealContext, extra_bytes: int = 0) -> list[Candidate]:
    """The highest two-decimal utilization whose request fits the free memory with margin."""
    total, free = _total_bytes(ctx), _free_bytes(ctx)
    if not total or free is None:
        return []
    util = math.floor((free - util_margin_bytes(total) - extra_bytes) / total * 100) / 100
    if util <= 0:
        return []
    return [
        Candidate(
            {"--gpu-memory-utilization": f"{util:.2f}"},
            f"{free / GIB:.2f} GiB of {total / GIB:.2f} GiB are free; the request must fit in "
            f"them with {util_margin_bytes(total) / GIB:.2f} GiB to spare",
            "serve",
        )
    ]


def _kv_candidates(ctx: HealContext, current: Prediction | None) -> list[Candidate]:
    """A KV pool too small for one request: a larger pool (explicit bytes or utilization),
    or a shorter context."""
    out: list[Candidate] = []
    if current is None:
        return out
    p = current.memory
    needed = int(p.needed_bytes_for_max_len * (1 + KV_MARGIN)) + p.bytes_per_block
    explicit = _setting(ctx, "kv_cache_memory_bytes")
    free = _free_bytes(ctx)
    if explicit is not None:
        size = math.ceil(needed / MIB) * MIB
        if free is None or size < free - util_margin_bytes(p.total_bytes):
            out.append(Candidate({"--kv-cache-memory-bytes": str(size)},
                                 f"one request of {p.settings.max_model_len:,} tokens needs "
                                 f"{p.needed_bytes_for_max_len / MIB:.1f} MiB of KV; "
                                 f"{KV_MARGIN:.0%} more and a block to spare", "serve"))  # fmt: skip
    else:
        non_kv = p.requested_bytes - min(s.kv_cache_bytes for s in p.stages)
        util = math.ceil((non_kv + needed) / p.total_bytes * 100) / 100
        if util <= 1.0:
            out.append(Candidate({"--gpu-memory-utilization": f"{util:.2f}"},
                                 f"{non_kv / GIB:.2f} GiB go to everything but the KV cache; "
                                 f"one request of {p.settings.max_model_len:,} tokens needs "
                                 f"{needed / GIB:.3f} GiB more", "serve"))  # fmt: skip
    est = p.estimated_max_model_len or ctx.parsed.get("estimated_max_model_len")
    if est:
        block = p.block_size or 16
        length = int(est) // block * block
        if length >= block:
            out.append(Candidate({"--max-model-len": str(length)},
                                 f"the pool holds {int(est):,} tokens for one request; "
                                 f"{length:,} is the largest whole number of {block}-token blocks",
                                 "serve"))  # fmt: skip
    return out


def _batch_candidates(ctx: HealContext, current: Prediction | None) -> list[Candidate]:
    """An activation or sampler peak that did not fit: a smaller profiling batch."""
    out: list[Candidate] = []
    seqs = _setting(ctx, "max_num_seqs") or (
        current.memory.settings.max_num_seqs if current else None
    )
    tokens = _setting(ctx, "max_num_batched_tokens") or (
        current.memory.settings.max_num_batched_tokens if current else None
    )
    if seqs and int(seqs) > 1:
        new = max(int(seqs) // 2, ctx.workload.concurrency or 1)
        if new < int(seqs):
            out.append(Candidate({"--max-num-seqs": str(new)},
                                 f"half the {seqs} sequences the sampler warm-up and profiling "
                                 "are sized for", "serve"))  # fmt: skip
    if tokens and int(tokens) > 2048:
        out.append(Candidate({"--max-num-batched-tokens": str(max(int(tokens) // 2, 2048))},
                             f"half the {tokens}-token profiling batch", "serve"))  # fmt: skip
    return out


def _tp_candidates(ctx: HealContext) -> list[Candidate]:
    """Weights that do not fit one device: split them over more GPUs where there are more."""
    tp = int(_setting(ctx, "tensor_parallel_size") or 1)
    count = ctx.device.count if ctx.device is not None else 1
    out = []
    for size in (2, 4, 8):
        if tp < size <= count:
            out.append(Candidate({"--tensor-parallel-size": str(size)},
                                 f"the weights split over {size} GPUs", "serve"))  # fmt: skip
    return out


def _graph_bytes(ctx: HealContext, current: Prediction | None) -> int:
    stated = ctx.parsed.get("cudagraph_estimate_gib") or ctx.parsed.get("cudagraph_actual_gib")
    if stated:
        return int(float(stated) * GIB)
    return int(current.memory.cudagraph.value_bytes) if current is not None else 0
