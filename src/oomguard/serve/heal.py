"""The next configuration after a memory failure: the doctor's fix, accepted or refused.

The doctor diagnoses the failed launch's log and computes every fix (:mod:`oomguard.doctor.fixes`:
one margin rule, sized from the log's numbers and the memory model). serve tells it the memory
free now, so a utilization is sized to the lower of that and what the log states, then walks the
top finding's fixes in the doctor's order and runs the first one that passes all of these:

- it is a flag or an environment variable (an action for a person is not runnable);
- the configuration it gives was not launched before in this session;
- a changed utilization, or a larger explicit KV pool with what the engine needs beside it,
  leaves the doctor's margin (:func:`oomguard.doctor.fixes.margin_gib`) below the memory free
  now;
- it keeps the stated workload: ``--max-model-len`` not below the P99, ``--max-num-seqs``
  not below the concurrency;
- it keeps the model's numerics (``--quantization``, ``--kv-cache-dtype``, ``--dtype``)
  unless the user allowed a precision change;
- it needs no more GPUs than this machine has;
- the memory model, with the terms this session measured, predicts the start succeeds.

serve computes no fix of its own, so with the memory free at the failure still free the change
it runs is the first fix ``oomguard doctor LOG`` prints. Every refused fix is kept with its
reason, so the report says why nothing was tried.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from oomguard.doctor.findings import Fix
from oomguard.doctor.fixes import margin_gib
from oomguard.logs import ParsedLog
from oomguard.logs.follow import Failure
from oomguard.memory.engine import MemoryPrediction
from oomguard.memory.spec import ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device
from oomguard.serve.predict import Prediction, predict_command

GIB = 2**30
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# settings whose change changes the model's numbers, not only its memory
_PRECISION_SETTINGS = ("quantization", "kv_cache_dtype", "dtype")


@dataclass(frozen=True)
class HealWorkload:
    """What the server must keep serving whatever the heal changes (either may be unstated)."""

    p99_tokens: int | None = None
    concurrency: int | None = None


@dataclass(frozen=True)
class HealAttempt:
    """One of the doctor's fixes as a change to the command: flags (and environment) with
    values, and why."""

    changes: dict[str, str | None]
    why: str

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

    @classmethod
    def of(cls, fix: Fix) -> HealAttempt | None:
        """The fix as a change to run (None for an action a person must take)."""
        if fix.is_flag:
            # the fix's flag with its companions (``also``): they are one change
            changes = {
                name: None if value in (None, "") else str(value)
                for name, value in fix.flags().items()
            }
            return cls(changes, fix.why)
        if _ENV_NAME.fullmatch(fix.flag) and fix.value is not None:
            return cls({fix.flag: str(fix.value)}, fix.why)
        return None


@dataclass
class HealDecision:
    """The outcome: the next command (None when none passes), why, and what was refused."""

    cause: str
    summary: str
    command: EngineCommand | None = None
    attempt: HealAttempt | None = None
    prediction: Prediction | None = None
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (change, reason)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the ``heal`` event's payload)."""
        out: dict[str, Any] = {
            "cause": self.cause,
            "summary": self.summary,
            "rejected": [{"change": c, "reason": r} for c, r in self.rejected],
        }
        if self.attempt is not None:
            out.update(
                source="doctor",
                changes=self.attempt.changes,
                change=self.attempt.text,
                why=self.attempt.why,
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
    workload: HealWorkload = field(default_factory=HealWorkload)
    use_calibration: bool = True
    allow_precision_change: bool = False


def doctor_context(ctx: HealContext) -> Any:
    """What serve tells the doctor: the model, the command line, and the memory free now."""
    from oomguard.doctor.situation import Context

    free = ctx.free_bytes / GIB if ctx.free_bytes is not None else None
    return Context(model=ctx.command.model, command=ctx.command.display(), free_gib=free)


def decide(ctx: HealContext) -> HealDecision:
    """The next configuration after the failure in ``ctx.parsed`` (see the module docstring)."""
    from oomguard.doctor.diagnose import diagnose

    top = diagnose(ctx.parsed, doctor_context(ctx)).top
    decision = HealDecision(
        cause=top.cause if top else "unknown",
        summary=top.summary if top else "the log shows a memory failure the doctor cannot place",
    )
    for fix in top.ordered_fixes() if top else []:
        attempt = HealAttempt.of(fix)
        if attempt is None:
            decision.rejected.append((fix.as_text, "not a flag or environment variable to set"))
        elif _accept(ctx, attempt, decision):
            return decision
    return decision


def apply(command: EngineCommand, attempt: HealAttempt) -> EngineCommand:
    """``command`` with the attempt's flags and environment applied."""
    from dataclasses import replace

    for name, value in attempt.changes.items():
        if name.startswith("--"):
            command = command.with_flag(name, value)
        else:
            command = replace(command, env={**command.env, name: str(value)})
    return command


def _accept(ctx: HealContext, attempt: HealAttempt, decision: HealDecision) -> bool:
    """Check ``attempt``; on success fill ``decision`` and return True, else note why not."""
    try:
        new = apply(ctx.command, attempt)
        key = new.key()
    except Exception as exc:  # noqa: BLE001 - a fix the command reader refuses is not runnable
        decision.rejected.append((attempt.text, f"not a valid vLLM setting ({exc})"))
        return False
    if key in ctx.tried:
        decision.rejected.append((attempt.text, f"same configuration as launch {ctx.tried[key]}"))
        return False
    reason = (
        _precision_problem(ctx, new)
        or _margin_problem(ctx, new)
        or _workload_problem(ctx, new)
        or _parallel_problem(ctx, new)
    )
    if reason:
        decision.rejected.append((attempt.text, reason))
        return False
    prediction = _predict(ctx, new)
    reason = _pool_problem(ctx, new, prediction)
    if reason:
        decision.rejected.append((attempt.text, reason))
        return False
    if prediction is not None and not prediction.fits:
        problem = prediction.problems[0] if prediction.problems else "does not fit"
        decision.rejected.append(
            (attempt.text, f"the memory model predicts it still fails: {problem}")
        )
        return False
    decision.command, decision.attempt, decision.prediction = new, attempt, prediction
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


def margin_bytes(total_bytes: int) -> int:
    """The memory a fix must leave free: the doctor's margin for a device of ``total_bytes``."""
    return int(margin_gib(total_bytes / GIB) * GIB)


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
    margin = margin_bytes(total)
    if util * total > free - margin:
        return (
            f"utilization {util:g} asks {util * total / GIB:.2f} GiB; {free / GIB:.2f} GiB are "
            f"free and {margin / GIB:.2f} GiB must stay free"
        )
    return None


def _pool_problem(
    ctx: HealContext, new: EngineCommand, prediction: Prediction | None
) -> str | None:
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
    margin = margin_bytes(total)
    if int(pool) + non_kv > free - margin:
        return (
            f"a pool of {int(pool) / GIB:.3f} GiB and {non_kv / GIB:.2f} GiB beside it need more "
            f"than the {free / GIB:.2f} GiB free less the {margin / GIB:.2f} GiB margin"
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
