"""The live terminal view: each server against its plan, the GPUs, and the alerts firing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group
from rich.table import Table
from rich.text import Text

from oomguard.units import MIB, gib_text

if TYPE_CHECKING:
    from oomguard.watch.evaluate import TargetState
    from oomguard.watch.runner import Watch


def _usage_bar(usage: float | None, width: int = 10) -> Text:
    if usage is None:
        return Text("–")
    filled = min(width, round(usage * width))
    style = "red" if usage >= 0.90 else "yellow" if usage >= 0.85 else "green"
    return Text("█" * filled + "░" * (width - filled) + f" {usage:4.0%}", style=style)


def _pool(state: TargetState) -> str:
    s = state.sample
    live = s.snapshot.kv_cache_tokens if s and s.snapshot else None
    planned = state.plan.kv_cache_tokens if state.plan else None
    text = "–" if live is None else f"{live:,}"
    if planned is not None:
        text += f" (plan {planned:,})"
    return text


def _headroom(state: TargetState) -> str:
    s = state.sample
    if (
        not s
        or not s.snapshot
        or s.snapshot.kv_cache_usage is None
        or not s.snapshot.kv_cache_tokens
    ):
        return "–"
    free = (1 - s.snapshot.kv_cache_usage) * s.snapshot.kv_cache_tokens
    return f"{free:,.0f}"


def _requests(state: TargetState) -> str:
    snap = state.sample.snapshot if state.sample else None
    if snap is None:
        return "–"
    cap = snap.waiting_for_capacity
    parts = [f"{snap.requests_running or 0:g}", f"{snap.requests_waiting or 0:g}"]
    parts.append("–" if cap is None else f"{cap:g}")
    return "/".join(parts)


def _gpu(state: TargetState) -> str:
    s = state.sample
    if s is None or not s.gpus:
        return "–" if s is None or not s.gpu_note else "n/a"
    plan = state.plan
    cells = []
    for g in s.gpus:
        cell = f"{g.index}: {gib_text(g.used_bytes)}"
        if plan is not None:
            cell += f" (plan {gib_text(plan.requested_bytes)})"
        cells.append(cell)
    tail = " whole device" if s.gpu_source == "nvml-device" else ""
    return ", ".join(cells) + tail


def _trend(state: TargetState) -> str:
    parts = []
    for series, v in sorted(state.leaks.items()):
        if not v.ready:
            parts.append(f"{series} measuring")
            continue
        rate = v.slope_bytes_per_s * 60 / MIB
        text = f"{series} {rate:+.1f} MiB/min"
        if v.suspected and v.time_to_exhaustion_s is not None:
            text += f", full in {v.time_to_exhaustion_s / 3600:.1f} h"
        parts.append(text)
    return "; ".join(parts) or "–"


def render(watch: Watch) -> Group:
    """The whole view for the latest round."""
    table = Table(title="oomguard watch", title_justify="left", expand=False)
    table.add_column("server", no_wrap=True)
    for column in (
        "state",
        "KV pool tok",
        "KV used",
        "free tok",
        "run/wait/cap",
        "preempt",
        "GPU GiB",
        "RSS GiB",
        "trend",
    ):
        table.add_column(column, overflow="fold")
    for name, state in watch.evaluator.states.items():
        s = state.sample
        if s is None:
            table.add_row(name, "waiting")
            continue
        status = Text("up", "green") if s.up else Text("down", "red")
        usage = s.snapshot.kv_cache_usage if s.snapshot else None
        pre = state.recent_preemptions
        table.add_row(
            name,
            status,
            _pool(state),
            _usage_bar(usage),
            _headroom(state),
            _requests(state),
            "–" if pre is None else f"{pre:g}",
            _gpu(state),
            gib_text(s.host_rss_bytes),
            _trend(state),
        )
    parts: list[Table | Text] = [table]
    if watch.devices:
        gpus = Table(title="GPUs (NVML)", title_justify="left")
        for column in ("gpu", "name", "used GiB", "free GiB", "total GiB"):
            gpus.add_column(column)
        for d in watch.devices:
            gpus.add_row(
                str(d.index),
                d.name,
                gib_text(d.used_bytes),
                gib_text(d.free_bytes),
                gib_text(d.total_bytes),
            )
        parts.append(gpus)
    elif watch.gpu.available is False:
        parts.append(Text("no NVML on this host: GPU memory not watched", style="dim"))
    notes = sorted(
        {s.gpu_note for st in watch.evaluator.states.values() if (s := st.sample) and s.gpu_note}
    )
    parts.extend(Text(n, style="dim") for n in notes)
    firing = watch.tracker.firing()
    if firing:
        alerts = Table(title="alerts firing", title_justify="left")
        for column in ("alert", "severity", "server", "message"):
            alerts.add_column(column, overflow="fold")
        for obs in firing:
            sev = obs.severity or obs.rule.severity
            alerts.add_row(
                obs.rule.name,
                Text(sev, "red" if sev == "critical" else "yellow"),
                obs.server,
                obs.message,
            )
        parts.append(alerts)
    else:
        parts.append(Text("no alert firing", style="green"))
    return Group(*parts)
