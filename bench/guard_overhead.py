"""Overhead of `oomguard guard` vs LiteLLM's proxy, in front of the same minimal upstream.

Starts ``bench/_upstream.py`` (a fast canned OpenAI-style server) on loopback, then
``oomguard guard`` (one worker process) and, if installed, LiteLLM's proxy (one worker) in
front of it, and measures each target with the same load generator in separate processes:

* latency: one connection, back to back, non-streamed → p50 / p99, and *added* = target − direct;
* throughput: many connections, non-streamed → requests per second (and non-2xx count).

Load generator: ``wrk`` (C) when on PATH (``apt-get install wrk``), else a multi-connection
aiohttp client in its own process (recorded in the output). LiteLLM lives in its own venv so it
never touches the project's: create it once with

    python3 -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'

or pass ``--litellm PATH`` to its ``litellm`` executable; without it the LiteLLM rows are
skipped with a message. Run: ``.venv/bin/python bench/guard_overhead.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = Path(__file__).with_name("_upstream.py")
MODEL = "bench-model"
BODIES = {
    "chat": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello in four words, please."}],
            "max_tokens": 4,
        },
    ),
    "completions": (
        "/v1/completions",
        {"model": MODEL, "prompt": "Say hello in four words, please.", "max_tokens": 4},
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p = int(entry)
        children.setdefault(int(fields[1]), []).append(p)
        stats[p] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


@dataclass
class LoadResult:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    non_2xx: int
    errors: int


# -- load generators ------------------------------------------------------------------------
def _wrk_ms(text: str, label: str) -> float:
    m = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        return float("nan")
    v, unit = float(m.group(1)), m.group(2)
    return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v


def run_wrk(url: str, body: dict[str, object], connections: int, duration_s: int) -> LoadResult:
    script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
    script.write(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    script.close()
    threads = 1 if connections < 4 else 2
    out = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{connections}",
            f"-d{duration_s}s",
            "--latency",
            "-s",
            script.name,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=duration_s + 60,
    ).stdout
    os.unlink(script.name)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return LoadResult(
        requests_per_s=float(rps.group(1)) if rps else 0.0,
        p50_ms=_wrk_ms(out, "50%"),
        p99_ms=_wrk_ms(out, "99%"),
        requests=int(total.group(1)) if total else 0,
        non_2xx=int(non2xx.group(1)) if non2xx else 0,
        errors=sum(int(x) for x in errors.groups()) if errors else 0,
    )


async def _aiohttp_load(
    url: str, body: dict[str, object], connections: int, duration_s: float
) -> dict[str, object]:
    import aiohttp

    payload = json.dumps(body).encode()
    latencies: list[float] = []
    non_2xx = errors = 0
    stop_at = time.perf_counter() + duration_s

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal non_2xx, errors
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            try:
                async with session.post(
                    url, data=payload, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    if r.status >= 300:
                        non_2xx += 1
            except aiohttp.ClientError:
                errors += 1
            latencies.append(time.perf_counter() - t)

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(connections)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    n = len(latencies)
    return {
        "requests_per_s": n / elapsed,
        "p50_ms": latencies[n // 2] * 1000 if n else float("nan"),
        "p99_ms": latencies[min(int(n * 0.99), n - 1)] * 1000 if n else float("nan"),
        "requests": n,
        "non_2xx": non_2xx,
        "errors": errors,
    }


def run_aiohttp(url: str, body: dict[str, object], connections: int, duration_s: int) -> LoadResult:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--loadgen",
            url,
            json.dumps(body),
            str(connections),
            str(duration_s),
        ],
        capture_output=True,
        text=True,
        timeout=duration_s + 60,
    )
    return LoadResult(**json.loads(out.stdout))


# -- targets ------------------------------------------------------------------------------
def start_guard(upstream_url: str, port: int, tokenizer: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oomguard.cli",
            "guard",
            "--backend",
            upstream_url,
            "--port",
            str(port),
            "--tokenizer",
            tokenizer,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )


def start_litellm(
    binary: str, upstream_url: str, port: int, workdir: Path
) -> subprocess.Popen[bytes]:
    cfg = workdir / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream_url}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  set_verbose: false\n"
        "  json_logs: false\n"
    )
    # No master key: LiteLLM then skips authentication, the cheapest setting for it (the guard
    # does no authentication either). Its own check refuses to boot like that unless told.
    env = {
        **os.environ,
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    return subprocess.Popen(
        [
            binary,
            "--config",
            str(cfg),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=workdir,
    )


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description="guard overhead vs LiteLLM (see module docstring)")
    ap.add_argument("--endpoint", choices=sorted(BODIES), default="chat")
    ap.add_argument("--latency-seconds", type=int, default=5)
    ap.add_argument("--throughput-seconds", type=int, default=8)
    ap.add_argument(
        "--connections",
        default="8,64",
        help="comma-separated connection counts for the throughput runs; the best is reported",
    )
    ap.add_argument("--litellm", default=str(ROOT / ".venv-litellm" / "bin" / "litellm"))
    ap.add_argument("--loadgen-kind", choices=["auto", "wrk", "aiohttp"], default="auto")
    ap.add_argument("--loadgen", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen:
        url, body, conns, dur = args.loadgen
        print(json.dumps(asyncio.run(_aiohttp_load(url, json.loads(body), int(conns), float(dur)))))
        return 0

    use_wrk = args.loadgen_kind == "wrk" or (args.loadgen_kind == "auto" and shutil.which("wrk"))
    load = run_wrk if use_wrk else run_aiohttp
    loadgen_name = "wrk (C, separate process)" if use_wrk else "aiohttp client (separate process)"
    path, body = BODIES[args.endpoint]

    procs: list[subprocess.Popen[bytes]] = []
    targets: list[tuple[str, str, subprocess.Popen[bytes] | None]] = []
    workdir = Path(tempfile.mkdtemp(prefix="guard-overhead-"))
    try:
        up_port = free_port()
        upstream = subprocess.Popen([sys.executable, str(UPSTREAM), "--port", str(up_port)])
        procs.append(upstream)
        up_url = f"http://127.0.0.1:{up_port}"
        if not wait_http(up_url + "/health", 10, upstream):
            print("upstream did not start", file=sys.stderr)
            return 1
        targets.append(("direct (upstream)", up_url, None))
        for mode, label in (
            ("backend", "oomguard guard (exact /tokenize)"),
            ("estimate", "oomguard guard (estimated prompt)"),
        ):
            port = free_port()
            g = start_guard(up_url, port, mode)
            procs.append(g)
            if not wait_http(f"http://127.0.0.1:{port}/ready", 20, g):
                print(f"guard ({mode}) did not become ready", file=sys.stderr)
                return 1
            targets.append((label, f"http://127.0.0.1:{port}", g))
        litellm_note = ""
        if Path(args.litellm).exists():
            port = free_port()
            lp = start_litellm(args.litellm, up_url, port, workdir)
            procs.append(lp)
            if wait_http(f"http://127.0.0.1:{port}/health/liveliness", 120, lp):
                targets.append(("LiteLLM proxy (1 worker)", f"http://127.0.0.1:{port}", lp))
            else:
                litellm_note = "LiteLLM proxy did not start within 120 s; skipped"
        else:
            litellm_note = (
                f"LiteLLM not installed at {args.litellm}; skipped (python3 -m venv .venv-litellm "
                "&& .venv-litellm/bin/pip install 'litellm[proxy]')"
            )

        # Warm every target, and check each answers the request correctly.
        for name, url, _ in targets:
            req = urllib.request.Request(
                url + path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                answer = json.loads(r.read())
                assert answer.get("choices"), (name, answer)
            load(url + path, body, 4, 1)

        lat: dict[str, LoadResult] = {}
        for name, url, _ in targets:
            lat[name] = load(url + path, body, 1, args.latency_seconds)
        levels = [int(c) for c in str(args.connections).split(",")]
        tput: dict[str, LoadResult] = {}
        per_level: dict[str, dict[int, LoadResult]] = {}
        cpu: dict[str, float] = {}
        for name, url, proc in targets:
            per_level[name] = {}
            for conns in levels:
                c0 = cpu_seconds(proc.pid) if proc else 0.0
                t0 = time.monotonic()
                res = load(url + path, body, conns, args.throughput_seconds)
                per_level[name][conns] = res
                if name not in tput or res.requests_per_s > tput[name].requests_per_s:
                    tput[name] = res
                    if proc:
                        cpu[name] = (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(workdir, ignore_errors=True)

    direct = lat["direct (upstream)"]
    print("\nguard overhead benchmark (non-streamed, loopback)")
    print(
        f"  machine: {os.cpu_count()} cores (shared), load average {os.getloadavg()[0]:.2f}; "
        f"python {sys.version.split()[0]}"
    )
    print(f"  endpoint: POST {path}  body: {json.dumps(body)}")
    print(f"  load generator: {loadgen_name}")
    print(
        f"  latency: 1 connection, back to back, {args.latency_seconds} s per target; "
        f"throughput: {args.connections} connections, {args.throughput_seconds} s per target"
    )
    print("  each proxy: one worker process; upstream: bench/_upstream.py (canned answers)\n")
    header = (
        f"  {'target':34} {'p50 ms':>8} {'p99 ms':>8} {'p50 +ms':>8} {'p99 +ms':>8} "
        f"{'req/s':>9} {'non-2xx':>8} {'cpu':>6}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name, _, _ in targets:
        la, tp = lat[name], tput[name]
        added50 = la.p50_ms - direct.p50_ms
        added99 = la.p99_ms - direct.p99_ms
        is_direct = name.startswith("direct")
        print(
            f"  {name:34} {la.p50_ms:8.3f} {la.p99_ms:8.3f} "
            f"{'' if is_direct else f'{added50:8.3f}':>8} {'' if is_direct else f'{added99:8.3f}':>8} "
            f"{tp.requests_per_s:9.0f} {tp.non_2xx + tp.errors + la.non_2xx + la.errors:8d} "
            f"{'' if is_direct else f'{cpu.get(name, 0):5.2f}c':>6}"
        )
    print("\n  throughput by connections (req/s, failed = non-2xx + socket errors/timeouts):")
    for name, _, _ in targets:
        cells = ", ".join(
            f"c={c}: {r.requests_per_s:.0f} ({r.non_2xx + r.errors} failed)"
            for c, r in per_level[name].items()
        )
        print(f"    {name:34} {cells}")
    if litellm_note:
        print(f"\n  {litellm_note}")
    guard_name = "oomguard guard (exact /tokenize)"
    g_lat, g_tp = lat[guard_name], tput[guard_name]
    print(
        "\n  targets (guard, exact tokenization): "
        f"p50 added {g_lat.p50_ms - direct.p50_ms:.3f} ms (≤ 1 ms: "
        f"{'yes' if g_lat.p50_ms - direct.p50_ms <= 1.0 else 'NO'}), "
        f"{g_tp.requests_per_s:.0f} req/s (≥ 2000: {'yes' if g_tp.requests_per_s >= 2000 else 'NO'})"
    )
    ll = "LiteLLM proxy (1 worker)"
    if ll in lat:
        print(
            f"  vs LiteLLM: p50 added {lat[ll].p50_ms - direct.p50_ms:.3f} ms, "
            f"{tput[ll].requests_per_s:.0f} req/s"
        )
    print("  cpu = cores the proxy process used during its throughput run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
