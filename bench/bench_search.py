"""The figures of `oomguard bench` on real vLLM (CPU), all in one run on one server.

vLLM serves a generated Llama-style model (``--model``, default ``medium-llama``: 6 layers,
hidden 768, GQA 12/4, dummy weights, a GPU-like 5-6 ms decode step on 2 cores; see
tests/integration/README.md) with a pool of 16 blocks of 128 tokens (15 usable) and
``--max-model-len 1024``. The load is ``--prompt-tokens`` + ``--max-tokens`` (default 100 +
156: two blocks per request, so 7 fit under the 0.95 high watermark and an 8th preempts).

Printed:

1. The search (from the pool's guess, and from concurrency 1) against an exhaustive sweep
   of every concurrency 1..``--sweep-max`` (one synchronized wave of distinct requests each,
   preemptions from vLLM's counter): the difference must be within ±1.
2. How fast a stage stops: ``--repeat`` stages one above the safe point with generated
   prompts (the client counts the KV its requests need and stops them before the engine
   preempts) and with replayed prompt texts (the client cannot count; vLLM's counter, read
   every 0.25 s, is the signal). Per stage: time from the first sign to every request
   cancelled, and the upper bound from the last clean sample to it.
3. ``vllm bench serve`` and ``oomguard bench`` at one concurrency, the same load, one after
   the other on the same server: request and token counts, the server's own counts, and the
   latency percentiles side by side.
4. The HTML report of the search and a Chromium screenshot of it (``--report DIR``).

Conditions (load average, CPUs, vLLM version) are printed with the figures. Needs the vLLM
venv (``$OOMGUARD_VLLM_VENV``, default ``.venv-vllm``). Run:
``.venv/bin/python bench/bench_search.py [--model tiny-llama] [--report DIR] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from burst import make_prompts, run_burst  # noqa: E402
from tinymodel import SHAPES, create_tiny_model, prompt_of_tokens  # noqa: E402
from vllm_bench import vllm_bench_serve  # noqa: E402
from vllm_server import (  # noqa: E402
    ServeConfig,
    VllmServer,
    fetch_metrics,
    metric_value,
    running_vllm,
    vllm_venv,
    vllm_venv_problem,
)

from oomguard.bench.html import write_report  # noqa: E402
from oomguard.bench.report import result_dict  # noqa: E402
from oomguard.bench.runner import BenchResult, BenchSettings, run_bench  # noqa: E402
from oomguard.bench.workload import FixedWorkload, ReplayWorkload, RequestShape  # noqa: E402

POOL_BLOCKS = 16
MAX_MODEL_LEN = 1024


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until the server runs and queues nothing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = fetch_metrics(url)
        if not metric_value(text, "vllm:num_requests_running") and not metric_value(
            text, "vllm:num_requests_waiting"
        ):
            return
        time.sleep(0.2)


def search(url: str, p: int, m: int, start: int | None) -> tuple[BenchResult, float]:
    """One search; the result and its wall time."""
    wait_idle(url)
    t0 = time.monotonic()
    result = run_bench(
        BenchSettings(url=url, workload=FixedWorkload(p, m), start_concurrency=start)
    )
    return result, time.monotonic() - t0


def sweep(
    server: VllmServer, model_dir: Path, p: int, m: int, top: int
) -> dict[int, dict[str, Any]]:
    """Every concurrency 1..top: one wave of distinct requests at once, preemptions counted."""
    out = {}
    for c in range(1, top + 1):
        wait_idle(server.base_url)
        prompts = make_prompts(model_dir, c, p, 900_000 + 100 * c)
        burst = run_burst(f"c={c}", server.base_url, server.base_url, str(model_dir), prompts, m)
        out[c] = {"ok": burst.succeeded, "preemptions": burst.preemptions}
    return out


def stops(
    url: str, model_dir: Path, p: int, m: int, concurrency: int, repeat: int
) -> dict[str, list[dict[str, Any]]]:
    """``repeat`` over-capacity stages with generated prompts and with replayed texts."""
    out: dict[str, list[dict[str, Any]]] = {"generated prompts": [], "replayed prompt texts": []}
    for i in range(repeat):
        for kind in out:
            if kind == "generated prompts":
                workload: Any = FixedWorkload(p, m)
            else:
                texts = [
                    prompt_of_tokens(model_dir, p, seed=1_000_000 + 1000 * i + k)
                    for k in range(3 * concurrency)
                ]
                workload = ReplayWorkload(
                    tuple(RequestShape(0, m, t) for t in texts), "replay.jsonl"
                )
            wait_idle(url)
            result = run_bench(BenchSettings(url=url, workload=workload, concurrency=concurrency))
            st = result.stages[0]
            out[kind].append(
                {
                    "stop_reason": st.stop_reason,
                    "preemptions": st.preemptions,
                    "stop_latency_s": st.stop_latency_s,
                    "stop_bound_s": st.stop_bound_s,
                    "server_quiet_s": st.server_quiet_s,
                    "cancelled": sum(1 for r in st.records if r.cancelled),
                }
            )
    return out


def counters(url: str) -> dict[str, float]:
    text = fetch_metrics(url)
    return {
        "requests": metric_value(text, "vllm:request_success_total"),
        "prompt": metric_value(text, "vllm:prompt_tokens_total"),
        "generation": metric_value(text, "vllm:generation_tokens_total"),
    }


def compare_rounds(
    url: str, model_dir: Path, p: int, m: int, c: int, n: int, out_dir: Path, rounds: int
) -> list[dict[str, Any]]:
    """``rounds`` alternations of the two tools: a shared machine's load drifts, so each pair
    runs back to back and the spread across pairs shows how much of a difference is drift."""
    return [compare(url, model_dir, p, m, c, n, out_dir) for _ in range(rounds)]


def compare(
    url: str, model_dir: Path, p: int, m: int, c: int, n: int, out_dir: Path
) -> dict[str, Any]:
    """vllm bench serve, then oomguard bench, at concurrency ``c`` with ``n`` requests."""
    wait_idle(url)
    before = counters(url)
    theirs = vllm_bench_serve(
        vllm_venv(),
        url,
        str(model_dir),
        input_len=p,
        output_len=m,
        num_prompts=n,
        max_concurrency=c,
        out_dir=out_dir,
    )
    wait_idle(url)
    between = counters(url)
    result = run_bench(
        BenchSettings(url=url, workload=FixedWorkload(p, m), concurrency=c, requests=n)
    )
    ours = result.stages[0].summary()
    return {
        "vllm_bench_serve": {
            "requests": theirs["completed"],
            "failed": theirs["failed"],
            "prompt_tokens": theirs["total_input_tokens"],
            "output_tokens": theirs["total_output_tokens"],
            "server_counted": {k: between[k] - before[k] for k in before},
            "ttft_ms": (theirs["median_ttft_ms"], theirs["p99_ttft_ms"]),
            "tpot_ms": (theirs["median_tpot_ms"], theirs["p99_tpot_ms"]),
            "itl_ms": (theirs["median_itl_ms"], theirs["p99_itl_ms"]),
            "e2e_ms": (theirs["median_e2el_ms"], theirs["p99_e2el_ms"]),
            "output_tokens_per_s": theirs["output_throughput"],
        },
        "oomguard_bench": {
            "requests": ours["requests"]["ok"],
            "failed": ours["requests"]["errors"],
            "prompt_tokens": ours["prompt_tokens"],
            "output_tokens": ours["output_tokens"],
            "server_counted": ours["server_counters"],
            **{
                f"{k}_ms": (ours[f"{k}_s"]["p50"] * 1000, ours[f"{k}_s"]["p99"] * 1000)
                for k in ("ttft", "tpot", "itl", "e2e")
            },
            "output_tokens_per_s": ours["output_tokens_per_s"],
            "client_delay_ms_p99": (ours["client_delay_s"]["p99"] or 0) * 1000,
            "loop_lag_ms_p99": (ours["loop_lag_s"]["p99"] or 0) * 1000,
        },
    }


def screenshot(report_dir: Path) -> str:
    chromium = shutil.which("chromium")
    if not chromium:
        return "chromium not installed (scripts/setup-system.sh)"
    shot = report_dir / "report-screenshot.png"
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--enable-logging=stderr",
                "--v=0",
                "--window-size=1200,2600",
                f"--screenshot={shot}",
                (report_dir / "report.html").as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return f"{shot} ({len(console)} console messages{': ' + console[0] if console else ''})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="medium-llama", choices=sorted(SHAPES))
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=156)
    ap.add_argument("--sweep-max", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="over-capacity stages per prompt kind")
    ap.add_argument("--compare-concurrency", type=int, default=4)
    ap.add_argument("--compare-requests", type=int, default=28)
    ap.add_argument("--compare-rounds", type=int, default=2)
    ap.add_argument("--report", type=Path, default=None, help="write the search's report here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    problem = vllm_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    shape = SHAPES[args.model]
    p, m = args.prompt_tokens, args.max_tokens
    load_before = os.getloadavg()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        model = create_tiny_model(tmp_dir / shape.name, shape)
        config = ServeConfig(
            model_dir=model.path,
            kv_cache_memory_bytes=POOL_BLOCKS * model.kv_bytes_per_block,
            max_model_len=MAX_MODEL_LEN,
        )
        with running_vllm(config, tmp_dir / "vllm.log") as server:
            url = server.base_url
            guessed, guessed_s = search(url, p, m, None)
            grown, grown_s = search(url, p, m, 1)
            swept = sweep(server, model.path, p, m, args.sweep_max)
            safe = guessed.max_safe_concurrency or 1
            stopped = stops(url, model.path, p, m, safe + 1, args.repeat)
            compared = compare_rounds(
                url,
                model.path,
                p,
                m,
                args.compare_concurrency,
                args.compare_requests,
                tmp_dir,
                args.compare_rounds,
            )
            if args.report is not None:
                data = result_dict(guessed)
                write_report(data, args.report)
                (args.report / "bench.json").write_text(json.dumps(data, indent=1))
                out["report"] = screenshot(args.report)
        sweep_limit = 0
        for c in range(1, args.sweep_max + 1):
            if (
                swept[c]["preemptions"]
                or swept[c]["ok"] < c
                or c * -(-(p + m - 1) // 128) / (POOL_BLOCKS - 1) > 0.95
            ):
                break
            sweep_limit = c
    out.update(
        {
            "conditions": {
                "model": args.model,
                "pool": f"{POOL_BLOCKS} blocks of 128 tokens",
                "load": f"{p} + {m} tokens",
                "cpus": os.cpu_count(),
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
                "vllm_version": guessed.server.vllm_version,
            },
            "search_from_the_pool": {
                "max_safe": guessed.max_safe_concurrency,
                "stages": [(s.concurrency, s.safe) for s in guessed.stages],
                "wall_s": round(guessed_s, 1),
            },
            "search_from_1": {
                "max_safe": grown.max_safe_concurrency,
                "stages": [(s.concurrency, s.safe) for s in grown.stages],
                "wall_s": round(grown_s, 1),
            },
            "sweep": {"limit": sweep_limit, "by_concurrency": swept},
            "stops": stopped,
            "compare": compared,
        }
    )
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print_figures(out)
    return 0


def print_figures(out: dict[str, Any]) -> None:
    cond = out["conditions"]
    print(f"conditions: {cond}")
    for name in ("search_from_the_pool", "search_from_1"):
        s = out[name]
        print(
            f"{name}: max safe {s['max_safe']} in {len(s['stages'])} stages "
            f"{s['stages']} ({s['wall_s']} s)"
        )
    sw = out["sweep"]
    print(
        f"sweep: limit {sw['limit']}; "
        + ", ".join(
            f"c={c}: {v['ok']} ok, {v['preemptions']:g} preempted"
            for c, v in sw["by_concurrency"].items()
        )
    )
    for kind, runs in out["stops"].items():
        lat = [r["stop_latency_s"] for r in runs if r["stop_latency_s"] is not None]
        bound = [r["stop_bound_s"] for r in runs if r["stop_bound_s"] is not None]
        print(
            f"stops ({kind}): reasons {[r['stop_reason'] for r in runs]}, preemptions "
            f"{[r['preemptions'] for r in runs]}, after the sign max "
            f"{max(lat, default=0) * 1000:.0f} ms, bound max {max(bound, default=0) * 1000:.0f} ms "
            f"(median {statistics.median(bound) * 1000 if bound else 0:.0f} ms), server quiet "
            f"{[round(r['server_quiet_s'] or 0, 2) for r in runs]} s"
        )
    for i, c in enumerate(out["compare"], start=1):
        print(f"compare, round {i} (vllm bench serve | oomguard bench, back to back):")
        for key in c["vllm_bench_serve"]:
            print(
                f"  {key:22} {_fmt(c['vllm_bench_serve'][key])} | "
                f"{_fmt(c['oomguard_bench'].get(key))}"
            )
        for key in ("client_delay_ms_p99", "loop_lag_ms_p99"):
            print(f"  {key:22} - | {c['oomguard_bench'][key]:.1f}")
    if "report" in out:
        print(f"report screenshot: {out['report']}")


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return "p50 " + " / p99 ".join(f"{v:,.1f}" for v in value)
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
