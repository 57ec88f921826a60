"""What ``oomguard watch`` costs: its CPU share and memory while it watches 4 servers at 1 s.

Four real HTTP servers on loopback (aiohttp, in a separate process) serve a real ``/metrics``
page recorded from vLLM 0.32.0 after a burst (tests/integration/data/
metrics_vllm_0.32.0_after_burst.txt, ~400 lines, the histograms included), with the KV
usage and counters changing on every request so nothing is cached. ``oomguard watch URL×4
--interval 1 --port N`` runs as its own process; after a warm-up its CPU time (user + system,
from psutil) over the measured span gives the share of one core, and its resident memory is
read at the end. ``--port`` is on (the exporter is part of the cost) and ``/metrics`` of the
watcher is scraped every 15 s, as Prometheus would.

Run: ``nice .venv/bin/python bench/watch_cost.py [--seconds 120] [--servers 4] [--interval 1]``.
Target: under 1 % of a core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from oomguard.engine import start_group, stop_group

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "tests" / "integration" / "data" / "metrics_vllm_0.32.0_after_burst.txt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_pages(ports: list[int]) -> None:
    """Serve the recorded page on each port until killed (run in a child process)."""
    from aiohttp import web

    text = PAGE.read_text()
    rng = random.Random(0)
    counter = {"n": 0}

    async def metrics(_: web.Request) -> web.Response:
        counter["n"] += 1
        usage = rng.uniform(0.0, 0.95)
        body = text.replace(
            'kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0',
            f'kv_cache_usage_perc{{engine="0",model_name="tiny-llama"}} {usage:.4f}',
        ).replace(
            'num_preemptions_total{engine="0",model_name="tiny-llama"} 1.0',
            f'num_preemptions_total{{engine="0",model_name="tiny-llama"}} {counter["n"] // 50}.0',
        )
        return web.Response(text=body, content_type="text/plain")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    args = parser.parse_args()
    ports = [_free_port() for _ in range(args.servers)]
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import watch_cost; "
        f"watch_cost.serve_pages({ports!r})"
    )
    servers = start_group([sys.executable, "-c", code])
    watch_port = _free_port()
    exe = Path(sys.executable).parent / "oomguard"
    argv = [
        str(exe),
        "watch",
        *(f"http://127.0.0.1:{p}" for p in ports),
        "--interval",
        str(args.interval),
        "--port",
        str(watch_port),
        "--json",
    ]
    watch = start_group(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        proc = psutil.Process(watch.pid)
        time.sleep(args.warmup)
        if watch.poll() is not None:
            raise SystemExit(
                f"watch exited: {watch.stderr.read().decode() if watch.stderr else ''}"
            )
        t0, c0 = time.monotonic(), proc.cpu_times()
        next_scrape = t0
        scrapes = 0
        while time.monotonic() - t0 < args.seconds:
            if time.monotonic() >= next_scrape:
                urllib.request.urlopen(f"http://127.0.0.1:{watch_port}/metrics", timeout=5).read()
                scrapes += 1
                next_scrape += 15.0
            time.sleep(0.5)
        t1, c1 = time.monotonic(), proc.cpu_times()
        rss = proc.memory_info().rss
        cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
        share = 100.0 * cpu_s / (t1 - t0)
        load = os.getloadavg()
        print(
            f"servers: {args.servers} real HTTP servers on loopback serving a recorded vLLM 0.32.0 "
            f"/metrics page ({len(PAGE.read_text().splitlines())} lines)"
        )
        print(
            f"interval: {args.interval:g} s, measured {t1 - t0:.0f} s after {args.warmup:g} s "
            f"warm-up, {scrapes} scrapes of the watcher's own /metrics"
        )
        print(
            f"watcher CPU: {cpu_s:.2f} s in {t1 - t0:.0f} s = {share:.2f} % of one core "
            f"(target < 1 %): {'MET' if share < 1.0 else 'MISSED'}"
        )
        print(f"watcher memory: {rss / 2**20:.1f} MiB resident")
        print(
            f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} "
            f"{load[1]:.2f} {load[2]:.2f}"
        )
    finally:
        for p in (watch, servers):
            stop_group(p.pid, grace_s=10, leader=p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
