"""One self-contained HTML page of a run: the answer, the recommendation, the plots (inline
SVG), the stage table and the conditions. No script, no stylesheet or image from elsewhere:
it opens offline and can be mailed as one file."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import yaml

from oomguard.bench.plots import render_plots

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1100px;
color:#212121;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.answer{font-size:18px;margin:12px 0}.safe{color:#2e7d32;font-weight:700}.unsafe{color:#c62828;
font-weight:700}.cut{color:#f9a825;font-weight:700}
pre{background:#f5f5f5;padding:10px;overflow-x:auto;font-size:12px}
table{border-collapse:collapse;font-size:12px;width:100%}\
th,td{border:1px solid #ddd;padding:3px 6px;
text-align:right}th{background:#fafafa}td.l,th.l{text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:8px}.plots svg{max-width:100%;height:auto}
.note{color:#8d6e00}.dim{color:#757575}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _ms(stats: dict[str, Any], q: str) -> str:
    v = stats.get(q)
    return "-" if v is None else f"{v * 1000:,.0f}"


def _stage_rows(data: dict[str, Any]) -> str:
    rows = []
    for st in data["stages"]:
        verdict = {True: ("safe", "safe"), False: ("unsafe", "unsafe"), None: ("cut short", "cut")}[
            st["safe"]
        ]
        why = "; ".join(st["reasons"]) or st["stop_detail"] or ""
        req = st["requests"]
        kv = st["kv_peak"] if st["kv_peak"] is not None else st["kv_peak_client"]
        stop = "-" if st["stop_latency_s"] is None else f"{st['stop_latency_s'] * 1000:,.0f}"
        if st["stop_latency_s"] is not None and st["stop_bound_s"] is not None:
            stop += f" (≤ {st['stop_bound_s'] * 1000:,.0f})"
        cells = [
            st["index"],
            st["concurrency"],
            st["purpose"],
            f"{req['ok']}/{req['sent']}",
            "-" if st["preemptions"] is None else f"{st['preemptions']:g}",
            "-" if kv is None else f"{kv:.3f}",
            "-" if st["running_peak"] is None else f"{st['running_peak']:g}",
            "-" if st["waiting_peak"] is None else f"{st['waiting_peak']:g}",
            f"{st['output_tokens_per_s']:,.0f}",
            f"{_ms(st['ttft_s'], 'p50')} / {_ms(st['ttft_s'], 'p99')}",
            f"{_ms(st['itl_s'], 'p50')} / {_ms(st['itl_s'], 'p99')}",
            f"{_ms(st['e2e_s'], 'p50')} / {_ms(st['e2e_s'], 'p99')}",
            _ms(st["loop_lag_s"], "p99"),
            stop,
        ]
        tds = "".join(f"<td>{_e(c)}</td>" for c in cells)
        rows.append(
            f"<tr>{tds}<td class=l><span class={verdict[1]}>{verdict[0]}</span> "
            f"<span class=dim>{_e(why)}</span></td></tr>"
        )
    head = (
        "#",
        "concurrency",
        "purpose",
        "ok/sent",
        "preemptions",
        "KV peak",
        "running",
        "waiting",
        "out tok/s",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "e2e p50/p99 ms",
        "loop lag p99 ms",
        "stopped after ms (bound)",
    )
    ths = "".join(f"<th>{_e(h)}</th>" for h in head) + "<th class=l>verdict</th>"
    return f"<table><tr>{ths}</tr>{''.join(rows)}</table>"


def render_html(data: dict[str, Any], svgs: dict[str, str]) -> str:
    """The page for one run's data and its plots."""
    cond = data["conditions"]
    safe = data["max_safe_concurrency"]
    rec = data["recommended"] or {}
    if safe:
        answer = (
            f"Highest safe concurrency: <span class=safe>{safe}</span> "
            f"<span class=dim>({_e(cond.get('workload'))})</span>"
        )
    else:
        answer = (
            "<span class=unsafe>No safe concurrency: even the lowest tested "
            "preempted or failed.</span>"
        )
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        "<meta name=viewport content='width=device-width,initial-scale=1'>",
        f"<title>oomguard bench: {_e(cond.get('model'))}</title><style>{_CSS}</style></head><body>",
        f"<h1>oomguard bench</h1><div class=dim>{_e(cond.get('url'))} · {_e(cond.get('model'))} · "
        f"vLLM {_e(cond.get('vllm_version') or 'unknown')} · {_e(cond.get('started_at'))}</div>",
        f"<p class=answer>{answer}</p>",
    ]
    if rec.get("vllm_command"):
        parts.append(f"<h2>Recommended</h2><pre>{_e(rec['vllm_command'])}</pre>")
    if rec.get("guard_config"):
        parts.append(
            "<p>Guard configuration (<code>oomguard guard --config FILE</code>):</p>"
            f"<pre>{_e(yaml.safe_dump(rec['guard_config'], sort_keys=False))}</pre>"
        )
    measured = data.get("measured") or {}
    if measured:
        parts.append(
            f"<p>KV bytes per token: {_e(measured.get('kv_bytes_per_token') or 'unknown')} "
            f"<span class=dim>({_e(measured.get('kv_bytes_per_token_source'))})</span>; "
            f"KV tokens one request held at the safe point: "
            f"{_e(measured.get('kv_tokens_per_request') or 'unknown')}</p>"
        )
    if data["notes"]:
        parts.append(
            "<ul>" + "".join(f"<li class=note>{_e(n)}</li>" for n in data["notes"]) + "</ul>"
        )
    parts.append("<h2>Over time</h2><div class=plots>")
    parts += [f"<figure>{svgs[k]}</figure>" for k in ("kv_timeline", "queue_timeline") if k in svgs]
    parts.append("</div><h2>Against concurrency</h2><div class=plots>")
    parts += [f"<figure>{svgs[k]}</figure>" for k in ("throughput", "latency") if k in svgs]
    parts.append("</div><h2>Stages</h2>")
    parts.append(_stage_rows(data))
    parts.append(
        "<p class=dim>Latencies count from when each request was due (its slot freed), so "
        "time lost in the client counts. Stopped after: from the first sign (a sample "
        "showing the preemption, or the client seeing its requests' KV need reach the "
        "pool) to every request cancelled; the bound counts from the last sample without "
        "a preemption instead.</p>"
    )
    shown = {k: v for k, v in cond.items()}
    parts.append(f"<h2>Conditions</h2><pre>{_e(json.dumps(shown, indent=1))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(data: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``report.html`` and the PNGs into ``out_dir``; their paths by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    svgs = render_plots(data, out_dir)
    page = out_dir / "report.html"
    page.write_text(render_html(data, svgs), encoding="utf-8")
    files = {"html": page}
    files.update({name: out_dir / f"{name}.png" for name in svgs})
    return files
