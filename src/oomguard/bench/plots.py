"""The report's plots, drawn from the run's JSON (:func:`oomguard.bench.report.result_dict`).

matplotlib is imported here only, with the Agg backend, so no other command pays for it. Each
figure is written as a PNG and returned as SVG text for the self-contained HTML page.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

PLOTS = ("kv_timeline", "queue_timeline", "throughput", "latency")
# the SVG carries no creator/date block (it would name a web address)
_NO_SVG_METADATA = {"Creator": None, "Date": None, "Format": None, "Type": None}
_SAFE, _UNSAFE, _CUT = "#2e7d32", "#c62828", "#f9a825"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.dpi": 100,
            "font.size": 9,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "svg.fonttype": "none",
        }
    )
    return plt


def _stage_spans(ax: Any, data: dict[str, Any]) -> None:
    """Shade each stage and label it with its concurrency."""
    for i, st in enumerate(data["stages"]):
        start, end = st["start_s"], st["start_s"] + st["duration_s"]
        color = _SAFE if st["safe"] else (_CUT if st["safe"] is None else _UNSAFE)
        ax.axvspan(start, end, color=color, alpha=0.07 if i % 2 else 0.12, lw=0)
        ax.text(
            (start + end) / 2,
            1.0,
            f"c={st['concurrency']}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=7,
            color=color,
        )


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(r["t_s"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def kv_timeline(data: dict[str, Any], plt: Any) -> Any:
    """KV usage (server samples and the client's token-exact estimate) and preemptions."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    rows = data["timeline"]
    t, kv = _series(rows, "kv_usage")
    ax.plot(t, kv, ".-", color="#1565c0", lw=1.2, ms=3, label="vLLM kv_cache_usage_perc")
    t2, est = _series(rows, "client_kv_usage")
    if est:
        ax.plot(t2, est, "--", color="#6a1b9a", lw=0.9, label="held by bench's requests (client)")
    cond = data["conditions"]
    ax.axhline(cond.get("high_watermark", 0.95), color=_CUT, lw=1, ls=":", label="high watermark")
    ax.axhline(cond.get("kv_stop", 0.98), color=_UNSAFE, lw=1, ls=":", label="stop")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("KV cache usage")
    ax.set_xlabel("time (s)")
    ax2 = ax.twinx()
    tp, pre = _series(rows, "preemptions")
    ax2.step(tp, pre, where="post", color=_UNSAFE, lw=1.2, label="preemptions (in the stage)")
    ax2.set_ylabel("preemptions", color=_UNSAFE)
    ax2.set_ylim(bottom=0, top=max(pre + [1]) * 1.3)
    ax2.grid(False)
    _stage_spans(ax, data)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower left", fontsize=7, ncol=3, framealpha=0.8)
    ax.set_title("KV usage and preemptions over time", pad=14)
    return fig


def queue_timeline(data: dict[str, Any], plt: Any) -> Any:
    """Running and waiting requests (server), requests in flight (client), gateway queue."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    rows = data["timeline"]
    for key, label, style in (
        ("running", "running (server)", "-"),
        ("waiting", "waiting (server)", "-"),
        ("waiting_for_capacity", "waiting for KV (server)", "-."),
        ("in_flight", "in flight (client)", ":"),
        ("gateway_queue", "queued in the gateway", "--"),
    ):
        t, v = _series(rows, key)
        if v:
            ax.plot(t, v, style, lw=1.1, label=label, drawstyle="steps-post")
    ax.set_ylabel("requests")
    ax.set_xlabel("time (s)")
    ax.set_ylim(bottom=0)
    _stage_spans(ax, data)
    ax.legend(loc="upper left", fontsize=7, ncol=4, framealpha=0.8)
    ax.set_title("Running and waiting requests over time", pad=14)
    return fig


def _by_concurrency(data: dict[str, Any], *, ok_only: bool) -> list[dict[str, Any]]:
    stages = [
        st for st in data["stages"] if (st["requests"]["ok"] if ok_only else st["output_tokens"])
    ]
    return sorted(stages, key=lambda s: s["concurrency"])


def _mark_safe(ax: Any, data: dict[str, Any]) -> None:
    safe = data["max_safe_concurrency"]
    if safe:
        ax.axvline(safe, color=_SAFE, lw=1.5, ls="--", label=f"max safe = {safe}")
    top = max([st["concurrency"] for st in data["stages"]] + [safe or 1])
    ax.set_xlim(0, top + 1)
    ax.xaxis.get_major_locator().set_params(integer=True)


def throughput(data: dict[str, Any], plt: Any) -> Any:
    """Output tokens/s against concurrency, each stage coloured by its verdict."""
    fig, ax = plt.subplots(figsize=(4.4, 3.3))
    stages = _by_concurrency(data, ok_only=False)  # a stopped stage: its rate until the stop
    xs = [st["concurrency"] for st in stages]
    ax.plot(xs, [st["output_tokens_per_s"] for st in stages], "-", color="#90a4ae", lw=1)
    for st in stages:
        color = _SAFE if st["safe"] else (_CUT if st["safe"] is None else _UNSAFE)
        ax.plot(st["concurrency"], st["output_tokens_per_s"], "o", color=color, ms=6)
    _mark_safe(ax, data)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, max([st["output_tokens_per_s"] for st in stages] + [1.0]) * 1.15)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Throughput against concurrency")
    return fig


def latency(data: dict[str, Any], plt: Any) -> Any:
    """TTFT, inter-token and end-to-end latency percentiles against concurrency."""
    fig, ax = plt.subplots(figsize=(4.4, 3.3))
    stages = _by_concurrency(data, ok_only=True)
    xs = [st["concurrency"] for st in stages]
    for key, label, color in (
        ("ttft_s", "TTFT", "#1565c0"),
        ("e2e_s", "e2e", "#6a1b9a"),
        ("itl_s", "ITL", "#00838f"),
    ):
        for q, style in (("p50", "o-"), ("p99", "^--")):
            ys = [(st[key][q] or 0) * 1000 for st in stages]
            if any(ys):
                ax.plot(xs, ys, style, color=color, ms=4, lw=1, label=f"{label} {q}")
    _mark_safe(ax, data)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("ms (from when each request was due)")
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    ax.set_title("Latency against concurrency")
    return fig


_FIGURES: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "kv_timeline": kv_timeline,
    "queue_timeline": queue_timeline,
    "throughput": throughput,
    "latency": latency,
}


def render_plots(data: dict[str, Any], out_dir: Path | None) -> dict[str, str]:
    """Draw every plot; write ``<name>.png`` into ``out_dir`` (when given); return SVG texts."""
    plt = _pyplot()
    svgs: dict[str, str] = {}
    for name in PLOTS:
        fig = _FIGURES[name](data, plt)
        fig.tight_layout()
        if out_dir is not None:
            fig.savefig(out_dir / f"{name}.png", dpi=110)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata=_NO_SVG_METADATA)
        plt.close(fig)
        text = buf.getvalue()
        svgs[name] = re.sub(r"<metadata>.*?</metadata>", "", text[text.find("<svg") :], flags=re.S)
    return svgs
