"""A run as data (the JSON every other view is drawn from) and as rich tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from oomguard.bench.runner import BenchResult
from oomguard.bench.stage import Sample

SCHEMA_VERSION = 1


def _sample_row(s: Sample) -> dict[str, Any]:
    return {
        "t_s": round(s.t_s, 3),
        "stage": s.stage,
        "concurrency": s.concurrency,
        "in_flight": s.in_flight,
        "kv_usage": s.kv_usage,
        "client_kv_usage": _r(s.client_kv_usage),
        "preemptions": s.preemptions,
        "running": s.running,
        "waiting": s.waiting,
        "waiting_for_capacity": s.waiting_for_capacity,
        "gateway_queue": s.gateway_queue,
        "health_ok": s.health_ok,
        "gpu_used_bytes": s.gpu_used_bytes,
        "read_s": round(s.read_s, 4),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _prefix_cache(result: BenchResult) -> dict[str, Any] | None:
    """The hit rate over the stages and what the seeds' step 6 makes of it (None: the server
    exports no prefix-cache counters, or looked nothing up: prefix caching off)."""
    window = result.prefix_cache
    if window is None or not window.queries:
        return None
    from oomguard.calibration.prefix import advise

    advice = advise(window, source=f"bench {result.server.url}")
    return {**window.to_dict(), "flag": advice.flag, "advice": advice.reason}


def result_dict(result: BenchResult) -> dict[str, Any]:
    """The whole run as plain data: the figures, the recommendation, every stage and sample."""
    rec = result.recommendation
    return {
        "schema_version": SCHEMA_VERSION,
        "max_safe_concurrency": result.max_safe_concurrency,
        "exact": result.exact,
        "first_guess": result.first_guess,
        "recommended": None
        if rec is None
        else {
            "max_num_seqs": rec.max_num_seqs,
            "high_watermark": rec.high_watermark,
            "low_watermark": rec.low_watermark,
            "kv_bytes_per_token": rec.kv_bytes_per_token,
            "vllm_command": rec.vllm_command,
            "guard_config": rec.guard_config,
        },
        "measured": None
        if rec is None
        else {
            "kv_bytes_per_token": rec.kv_bytes_per_token,
            "kv_bytes_per_token_source": rec.kv_bytes_per_token_source,
            "kv_tokens_per_request": rec.kv_tokens_per_request_measured,
            "blocks_per_request": rec.blocks_per_request,
        },
        "stops": [
            {
                "stage": st.spec.index,
                "concurrency": st.concurrency,
                "reason": st.stop_reason,
                "preemptions": st.preemptions,
                "stop_latency_s": _r(st.stop_latency_s),
                "stop_bound_s": _r(st.stop_bound_s),
                "server_quiet_s": _r(st.server_quiet_s),
            }
            for st in result.stops
        ],
        "stopped_by": result.stopped_by,
        "stages": [st.summary() for st in result.stages],
        "conditions": result.conditions,
        "notes": list(result.notes) + (list(rec.notes) if rec else []),
        "calibration": result.calibration,
        "prefix_cache": _prefix_cache(result),
        "timeline": [_sample_row(s) for s in result.samples],
    }


def write_json(result: BenchResult, path: Path) -> Path:
    """Write :func:`result_dict` to ``path``."""
    path.write_text(json.dumps(result_dict(result), indent=1) + "\n")
    return path


def _ms(stats: dict[str, Any], key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{value * 1000:,.0f}"


def _verdict(stage: dict[str, Any]) -> Text:
    if stage["safe"] is True:
        return Text("safe", style="green")
    if stage["safe"] is None:
        return Text("cut short", style="yellow")
    return Text("unsafe", style="red")


def stage_table(data: dict[str, Any]) -> Table:
    """One row per stage: load, server figures, client latencies, verdict."""
    t = Table(title="Stages", header_style="bold", show_lines=False)
    for name in (
        "#",
        "conc",
        "ok/sent",
        "preempt",
        "KV peak",
        "run/wait",
        "out tok/s",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "e2e p50/p99 ms",
        "lag p99 ms",
        "verdict",
    ):
        t.add_column(name, justify="right" if name not in ("verdict",) else "left")
    for st in data["stages"]:
        req = st["requests"]
        kv = st["kv_peak"] if st["kv_peak"] is not None else st["kv_peak_client"]
        run = "-" if st["running_peak"] is None else f"{st['running_peak']:g}"
        wait = "-" if st["waiting_peak"] is None else f"{st['waiting_peak']:g}"
        verdict = _verdict(st)
        if st["stop_reason"]:
            verdict.append(f" ({st['stop_reason']})", style="dim")
        t.add_row(
            f"{st['index']}{'h' if st['purpose'] == 'hold' else ''}",
            str(st["concurrency"]),
            f"{req['ok']}/{req['sent']}",
            "-" if st["preemptions"] is None else f"{st['preemptions']:g}",
            "-" if kv is None else f"{kv:.3f}",
            f"{run}/{wait}",
            f"{st['output_tokens_per_s']:,.0f}",
            f"{_ms(st['ttft_s'], 'p50')}/{_ms(st['ttft_s'], 'p99')}",
            f"{_ms(st['itl_s'], 'p50')}/{_ms(st['itl_s'], 'p99')}",
            f"{_ms(st['e2e_s'], 'p50')}/{_ms(st['e2e_s'], 'p99')}",
            _ms(st["loop_lag_s"], "p99"),
            verdict,
        )
    return t


def summary_renderable(data: dict[str, Any]) -> Group:
    """The stage table, the answer, the recommendation and the notes."""
    parts: list[Any] = [stage_table(data)]
    safe = data["max_safe_concurrency"]
    cond = data["conditions"]
    for st in data["stages"]:
        if st["reasons"] or st["stop_detail"]:
            why = "; ".join(st["reasons"]) or st["stop_detail"]
            parts.append(
                Text(f"stage {st['index']} (concurrency {st['concurrency']}): {why}", style="dim")
            )
    fixed = data["exact"] is None
    if safe and fixed:
        parts.append(
            Text.assemble(
                ("concurrency ", "bold"),
                (str(safe), "bold green"),
                (" holds", "bold"),
                f"  [{cond.get('workload')}]",
            )
        )
    elif safe:
        exact = "" if data["exact"] else " (not bracketed by an unsafe stage: see the stages)"
        parts.append(
            Text.assemble(
                ("max safe concurrency: ", "bold"),
                (str(safe), "bold green"),
                f"{exact}  [{cond.get('workload')}]",
            )
        )
    elif fixed:
        parts.append(Text("the concurrency tested does not hold (see the stage)", style="bold red"))
    else:
        parts.append(
            Text(
                "no safe concurrency: even the lowest tested preempted or failed", style="bold red"
            )
        )
    rec = data["recommended"] or {}
    if rec.get("vllm_command"):
        parts.append(Text.assemble(("vLLM:  ", "bold"), rec["vllm_command"]))
    if rec.get("high_watermark") is not None:
        parts.append(
            Text.assemble(
                ("guard: ", "bold"),
                f"--high-watermark {rec['high_watermark']} --low-watermark {rec['low_watermark']}",
            )
        )
    measured = data.get("measured") or {}
    if measured.get("kv_bytes_per_token"):
        parts.append(
            Text(
                f"KV: {measured['kv_bytes_per_token']:,.1f} bytes per token "
                f"({measured['kv_bytes_per_token_source']})"
            )
        )
    for stop in data["stops"]:
        what = "a preemption" if stop["reason"] == "preemption" else "a full pool"
        bound = (
            ""
            if stop["stop_bound_s"] is None
            else (
                f", at most {stop['stop_bound_s'] * 1000:,.0f} ms after the last sample "
                "without a preemption"
            )
        )
        parts.append(
            Text(
                f"stage {stop['stage']} stopped at {what} {stop['stop_latency_s'] * 1000:,.0f} ms "
                f"after the first sign{bound} ({stop['preemptions'] or 0:g} preemption(s))"
            )
        )
    prefix = data.get("prefix_cache")
    if prefix:
        flag = f"{prefix['flag']}: " if prefix["flag"] else ""
        parts.append(Text.assemble(("prefix cache: ", "bold"), f"{flag}{prefix['advice']}"))
    for note in data["notes"]:
        parts.append(Text(f"note: {note}", style="yellow"))
    return Group(*parts)


def print_summary(data: dict[str, Any], console: Console) -> None:
    """Print the tables and the recommendation."""
    console.print(summary_renderable(data))
