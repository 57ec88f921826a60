"""Turn samples into observations for every rule: what each alert sees this round.

:class:`Evaluator` keeps the little history the rules need (the preemption counter over the
last minute, a leak detector per memory series) and, for each round of samples, returns one
:class:`~oomguard.watch.alerts.Observation` per rule and target (and GPU), plus the derived
figures the view and the exporter show (:class:`TargetState`).
"""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass, field

from oomguard.engine.memory import DeviceMemory
from oomguard.units import GIB, MIB
from oomguard.watch import rules as R
from oomguard.watch.alerts import Observation, observe
from oomguard.watch.leak import LeakDetector, LeakVerdict
from oomguard.watch.plan_figures import PlanFigures
from oomguard.watch.sampling import TargetSample


@dataclass
class LeakSettings:
    """The leak detector's parameters (``--leak-window``, ``--leak-rate``, ``--leak-settle``)."""

    window_s: float = R.LEAK_WINDOW_S
    min_rate_bytes_per_s: float = R.MEMORY_LEAK.threshold
    settle_s: float = R.LEAK_SETTLE_S

    def detector(self) -> LeakDetector:
        """A fresh detector with these parameters."""
        return LeakDetector(
            window_s=self.window_s,
            min_rate_bytes_per_s=self.min_rate_bytes_per_s,
            settle_s=self.settle_s,
        )


@dataclass
class TargetState:
    """What the watcher derived for one target: the latest sample and the figures around it."""

    sample: TargetSample | None = None
    plan: PlanFigures | None = None
    recent_preemptions: float | None = None
    leaks: dict[str, LeakVerdict] = field(default_factory=dict)  # series → verdict
    preemption_history: deque[tuple[float, float]] = field(default_factory=deque)
    detectors: dict[str, LeakDetector] = field(default_factory=dict)
    pids: tuple[int, ...] = ()
    was_up: bool = False
    started_at_s: float | None = None  # the server process's start time (its /metrics)
    deaths: deque[float] = field(default_factory=deque)  # when each death was seen


def _fmt_gib(value_bytes: float) -> str:
    return f"{value_bytes / GIB:.2f} GiB"


class Evaluator:
    """The rules applied to each round; one instance per watch run."""

    def __init__(
        self,
        plans: dict[str, PlanFigures | None],
        leak: LeakSettings | None = None,
        free_margin_bytes: float = R.GPU_FREE_LOW.threshold,
        available_host_bytes: float | None = None,
        preemption_window_s: float = R.PREEMPTION_WINDOW_S,
    ) -> None:
        self.leak = leak or LeakSettings()
        self.preemption_window_s = preemption_window_s
        self.free_rule = R.AlertRule(
            **{
                **R.GPU_FREE_LOW.__dict__,
                "threshold": free_margin_bytes,
                "clear": free_margin_bytes + 0.25 * GIB,
            }
        )
        rate = self.leak.min_rate_bytes_per_s
        self.leak_rule = R.AlertRule(
            **{**R.MEMORY_LEAK.__dict__, "threshold": rate, "clear": rate / 2}
        )
        self.available_host_bytes = available_host_bytes
        self.states: dict[str, TargetState] = {n: TargetState(plan=p) for n, p in plans.items()}
        self.host = socket.gethostname()

    def round(
        self, samples: list[TargetSample], devices: list[DeviceMemory] | None
    ) -> list[Observation]:
        """Observations for one round of samples (and the host's GPUs)."""
        out: list[Observation] = []
        for s in samples:
            state = self.states.setdefault(s.name, TargetState())
            state.sample = s
            out.extend(self._target(s, state))
        for d in devices or ():
            free = float(d.free_bytes)
            out.append(
                observe(
                    self.free_rule,
                    self.host,
                    free,
                    f"GPU {d.index} ({d.name}): {_fmt_gib(free)} free of "
                    f"{_fmt_gib(d.total_bytes)}, below the "
                    f"{_fmt_gib(self.free_rule.threshold)} margin",
                    gpu=str(d.index),
                )
            )
        return out

    def _target(self, s: TargetSample, state: TargetState) -> list[Observation]:
        down = observe(
            R.SERVER_DOWN,
            s.name,
            0.0 if s.up else 1.0,
            f"{s.name} does not answer: {s.error}" if not s.up else f"{s.name} answers",
        )
        restarted = s.up and s.pids != state.pids and bool(state.pids) and bool(s.pids)
        dying = self._deaths(s, state, restarted)
        # while it does not answer only a breach is news (its other alerts keep their state)
        out = [down, dying] if s.up or dying.breached else [down]
        if not s.up:
            return out
        state.pids = s.pids
        if s.snapshot is not None:
            out.extend(self._vllm(s, state))
        out.extend(self._memory(s, state, restarted))
        return out

    def _deaths(self, s: TargetSample, state: TargetState, new_pids: bool) -> Observation:
        """Deaths in the window: the server stopped answering after it answered, or answers
        as a new process (other PIDs, a later start time) although every sample saw it up."""
        started = s.snapshot.process_start_time_s if s.snapshot is not None else None
        new_start = started is not None and state.started_at_s not in (None, started)
        if state.was_up and (not s.up or new_pids or new_start):
            state.deaths.append(s.at_s)
        state.was_up = s.up
        if started is not None:
            state.started_at_s = started
        while state.deaths and state.deaths[0] <= s.at_s - R.DEATH_WINDOW_S:
            state.deaths.popleft()
        count = float(len(state.deaths))
        return observe(
            R.ENGINE_DYING,
            s.name,
            count,
            f"{s.name} died {count:g} time(s) in the last {_duration(R.DEATH_WINDOW_S)} "
            "(a crash that repeats is seldom memory: see its log, or oomguard doctor)",
        )

    def _vllm(self, s: TargetSample, state: TargetState) -> list[Observation]:
        snap = s.snapshot
        assert snap is not None
        out: list[Observation] = []
        if snap.kv_cache_usage is not None:
            usage = snap.kv_cache_usage
            for rule in (R.KV_HIGH, R.KV_CRITICAL):
                out.append(
                    observe(
                        rule,
                        s.name,
                        usage,
                        f"KV cache {usage:.0%} used (alert at {rule.threshold:.0%}, "
                        f"clears below {rule.clear:.0%}){_pool_text(snap.kv_cache_tokens)}",
                    )
                )
        recent = self._preemptions(s, state)
        if recent is not None:
            out.append(
                observe(
                    R.PREEMPTIONS,
                    s.name,
                    recent,
                    f"{recent:g} preemption(s) in the last {_duration(self.preemption_window_s)}: "
                    "the KV pool ran out and running requests were recomputed",
                )
            )
        waiting = snap.waiting_for_capacity
        if waiting is not None:
            out.append(
                observe(
                    R.WAITING_FOR_CAPACITY,
                    s.name,
                    waiting,
                    f"{waiting:g} request(s) waiting for KV capacity",
                )
            )
        plan = state.plan
        if plan is not None and snap.kv_cache_tokens and plan.kv_cache_tokens > 0:
            ratio = snap.kv_cache_tokens / plan.kv_cache_tokens
            out.append(
                observe(
                    R.KV_POOL_BELOW_PLAN,
                    s.name,
                    ratio,
                    f"KV pool {snap.kv_cache_tokens:,} tokens, the plan said "
                    f"{plan.kv_cache_tokens:,} ({ratio:.0%})",
                )
            )
        return out

    def _preemptions(self, s: TargetSample, state: TargetState) -> float | None:
        """Preemptions counted over the window (a minute by default; since watching began, if
        less), from the last sample at or before its start, so none inside it is missed."""
        snap = s.snapshot
        if snap is None or snap.preemptions_total is None:
            return None
        history = state.preemption_history
        if history and snap.preemptions_total < history[-1][1]:
            history.clear()  # the counter restarted with the server
        history.append((s.at_s, snap.preemptions_total))
        while len(history) > 1 and history[1][0] <= s.at_s - self.preemption_window_s:
            history.popleft()
        state.recent_preemptions = snap.preemptions_total - history[0][1]
        return state.recent_preemptions

    def _memory(self, s: TargetSample, state: TargetState, restarted: bool) -> list[Observation]:
        out: list[Observation] = []
        pool_ready = s.snapshot is None or s.snapshot.num_gpu_blocks is not None
        series: list[tuple[str, float, float | None]] = []
        if s.host_rss_bytes is not None:
            series.append(("host", float(s.host_rss_bytes), self.available_host_bytes))
        for g in s.gpus:
            series.append((f"gpu{g.index}", float(g.used_bytes), float(g.free_bytes)))
            out.extend(self._above_plan(s, state, g.index, g.used_bytes))
        for name, used, available in series:
            det = state.detectors.get(name)
            if det is None or restarted:
                det = state.detectors[name] = self.leak.detector()
            if not pool_ready:
                continue
            det.add(s.at_s, used, available)
            verdict = state.leaks[name] = det.verdict()
            if verdict.ready:
                out.append(
                    _leak_observation(self.leak_rule, s.name, name, verdict, self.leak.window_s)
                )
        return out

    def _above_plan(
        self, s: TargetSample, state: TargetState, gpu: int, used_bytes: int
    ) -> list[Observation]:
        plan = state.plan
        if plan is None or plan.requested_bytes <= 0:
            return []
        ratio = used_bytes / plan.requested_bytes
        whole = (
            " (whole device: other processes count too)" if s.gpu_source == "nvml-device" else ""
        )
        return [
            observe(
                R.MEMORY_ABOVE_PLAN,
                s.name,
                ratio,
                f"GPU {gpu}: engine holds {_fmt_gib(used_bytes)}, the plan allows "
                f"{_fmt_gib(plan.requested_bytes)} ({ratio:.0%}){whole}",
                gpu=str(gpu),
            )
        ]


def _pool_text(tokens: int | None) -> str:
    return f" of a {tokens:,}-token pool" if tokens else ""


def _leak_observation(
    rule: R.AlertRule, server: str, series: str, v: LeakVerdict, window_s: float
) -> Observation:
    rate_mib_min = v.slope_bytes_per_s * 60 / MIB
    where = (
        "host memory (RSS) of its processes" if series == "host" else f"memory on GPU {series[3:]}"
    )
    tte = v.time_to_exhaustion_s
    left = f", exhausted in {_duration(tte)} at this rate" if tte is not None else ""
    message = (
        f"{where} grows {rate_mib_min:.1f} MiB/min (robust slope over "
        f"{window_s / 60:g} min), now {v.used_bytes / GIB:.2f} GiB{left}"
    )
    severity = "critical" if tte is not None and tte < R.LEAK_CRITICAL_TTE_S else None
    still = v.ready and v.slope_bytes_per_s >= rule.clear
    return Observation(
        rule, server, v.slope_bytes_per_s, v.suspected, still, message, {"memory": series}, severity
    )


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
