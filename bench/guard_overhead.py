"""Overhead of `oomguard guard` vs LiteLLM's proxy, in front of the same minimal upstream.

Starts ``bench/_upstream.py`` (a fast canned OpenAI-style server standing in for vLLM: its
``/v1/models`` names the integration tests' generated model directory as ``root`` and its
``/tokenize`` counts with that model's tokenizer and chat template) on loopback, then one worker
process of each target in front of it:

* ``oomguard guard`` with exact prompt counts in-process (the model's tokenizer and chat
  template, checked against ``/tokenize`` for the first requests only);
* ``oomguard guard`` with exact prompt counts by ``/tokenize`` (``local_tokenizer: false``: a
  round trip per request);
* the in-process one on asyncio's own event loop (``event_loop: asyncio``) instead of uvloop's;
* ``oomguard guard`` with estimated prompt counts (no round trip);
* ``oomguard guard --track-progress always``: the tracked path a request takes under KV
  pressure (streamed upstream with per-chunk usage, progress read, the answer assembled);
* ``oomguard guard --redis-url``: admission shared through a local redis-server (a Lua
  capacity ledger synchronised in the background, no Redis call per request);
* LiteLLM's proxy (if installed), one worker.

Each target is measured with the same load generator in separate processes, non-streamed and
streamed (``"stream": true``; the time is to the end of the stream):

* latency: one connection, back to back → p50 / p99, and *added* = target − direct;
* throughput: several connection counts → the best requests per second (and failures).

Load generator: ``wrk`` (C) when on PATH (``apt-get install wrk``), else a multi-connection
aiohttp client in its own process (recorded in the output). LiteLLM lives in its own venv so it
never touches the project's: create it once with

    python3 -m venv .venv-litellm && .venv-litellm/bin/pip install 'litellm[proxy]'

or pass ``--litellm PATH`` to its ``litellm`` executable; without it the LiteLLM rows are
skipped with a message. Targets (per worker): added p50 ≤ 0.5 ms and ≥ 3,000 req/s
non-streamed; with Redis, added p99 ≤ 2 ms. Run: ``.venv/bin/python bench/guard_overhead.py``.
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
from typing import Any

from oomguard.engine import start_group, stop_group

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
def start_guard(upstream_url: str, port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    return start_group(
        [
            sys.executable,
            "-m",
            "oomguard.cli",
            "guard",
            "--backend",
            upstream_url,
            "--port",
            str(port),
            *extra,
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
    return start_group(
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
        stop_group(proc.pid, grace_s=10, leader=proc)


DIRECT = "direct (upstream)"
GUARD_EXACT = "guard (exact, in-process)"
GUARD_REMOTE = "guard (exact, /tokenize)"
GUARD_ESTIMATE = "guard (estimated prompt)"
GUARD_REDIS = "guard + Redis"
GUARD_ASYNCIO = "guard (exact, asyncio loop)"
LITELLM = "LiteLLM proxy (1 worker)"


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None


def _model_dir(workdir: Path) -> Path:
    """The integration tests' generated model (a BPE tokenizer and a chat template)."""
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from tinymodel import create_tiny_model

    return create_tiny_model(workdir / "tiny-llama").path


def _start_targets(
    args: argparse.Namespace, workdir: Path, procs: list[subprocess.Popen[bytes]]
) -> tuple[list[Target], list[str], object | None]:
    """Upstream, every guard variant and LiteLLM; returns targets, notes, the redis server."""
    notes: list[str] = []
    up_port = free_port()
    upstream = start_group(
        [
            sys.executable,
            str(UPSTREAM),
            "--port",
            str(up_port),
            "--model-dir",
            str(_model_dir(workdir)),
        ]
    )
    procs.append(upstream)
    up_url = f"http://127.0.0.1:{up_port}"
    if not wait_http(up_url + "/health", 20, upstream):
        raise RuntimeError("upstream did not start")
    targets = [Target(DIRECT, up_url, None)]
    redis_server = None
    asyncio_cfg = workdir / "asyncio-loop.yaml"
    asyncio_cfg.write_text("event_loop: asyncio\n")
    remote_cfg = workdir / "remote-tokenizer.yaml"
    remote_cfg.write_text("local_tokenizer: false\n")
    variants: list[tuple[str, list[str]]] = [
        (GUARD_EXACT, ["--tokenizer", "backend"]),
        (GUARD_REMOTE, ["--tokenizer", "backend", "--config", str(remote_cfg)]),
        (GUARD_ASYNCIO, ["--tokenizer", "backend", "--config", str(asyncio_cfg)]),
        (GUARD_ESTIMATE, ["--tokenizer", "estimate"]),
        ("guard (tracked path)", ["--track-progress", "always"]),
    ]
    if shutil.which("redis-server"):
        sys.path.insert(0, str(ROOT / "tests" / "integration"))
        from redis_server import RedisServer

        redis_server = RedisServer(workdir / "redis").start()
        variants.append((GUARD_REDIS, ["--redis-url", redis_server.url]))
    else:
        notes.append("redis-server not installed: the Redis row is skipped")
    variants = [(label, extra) for label, extra in variants if _selected(args, label)]
    for label, extra in variants:
        port = free_port()
        g = start_guard(up_url, port, extra)
        procs.append(g)
        if not wait_http(f"http://127.0.0.1:{port}/ready", 30, g):
            raise RuntimeError(f"{label} did not become ready")
        targets.append(Target(label, f"http://127.0.0.1:{port}", g))
    if not _selected(args, LITELLM):
        pass
    elif Path(args.litellm).exists():
        port = free_port()
        lp = start_litellm(args.litellm, up_url, port, workdir)
        procs.append(lp)
        wait_s = args.litellm_start_s
        if wait_http(f"http://127.0.0.1:{port}/health/liveliness", wait_s, lp):
            targets.append(Target(LITELLM, f"http://127.0.0.1:{port}", lp))
        else:
            notes.append(f"LiteLLM proxy did not start within {wait_s:.0f} s; skipped")
    else:
        notes.append(
            f"LiteLLM not installed at {args.litellm}; skipped (python3 -m venv .venv-litellm "
            "&& .venv-litellm/bin/pip install 'litellm[proxy]')"
        )
    return targets, notes, redis_server


def count_cost_us(model_dir: Path, body: dict[str, object], rounds: int = 2000) -> dict[str, float]:
    """CPU microseconds one prompt count takes in this process (best of 5 rounds): the model's
    tokenizer and chat template, and the estimate. Process time, so other load on the machine
    changes it less than the wall-clock rows."""
    from oomguard.guard.openai_body import estimate_prompt_tokens, parse_generation
    from oomguard.guard.tokenizer import ModelTokenizer, count_request

    tok = ModelTokenizer.load(model_dir)
    req = parse_generation(dict(body), chat="messages" in body)
    out = {}
    for name, fn in (
        ("in-process", lambda: count_request(tok, req, 8192)),
        ("estimate", lambda: estimate_prompt_tokens(req, 3.0)),
    ):
        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(rounds):
                fn()
            best = min(best, (time.process_time() - t0) / rounds * 1e6)
        out[name] = best
    return out


def _selected(args: argparse.Namespace, label: str) -> bool:
    """Whether ``--only`` (comma-separated parts of target names) keeps this target."""
    if not args.only:
        return True
    return any(part.strip().lower() in label.lower() for part in args.only.split(","))


def _wait_in_process_counts(targets: list[Target], path: str, body: dict[str, object]) -> None:
    """Send the body to every guard until its tokenizer is loaded and checked against the
    upstream's ``/tokenize`` (the first requests of a kind are counted both ways)."""
    kind = "chat" if "messages" in body else "completion"
    for t in targets:
        if t.proc is None or t.name in (GUARD_REMOTE, GUARD_ESTIMATE, LITELLM):
            continue
        deadline = time.monotonic() + 60
        while True:
            req = urllib.request.Request(
                t.url + path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=30).read()
            with urllib.request.urlopen(t.url + "/status", timeout=30) as r:
                local = json.loads(r.read()).get("local_tokenizers", {})
            if any(kind in m.get("verified", []) for m in local.values()):
                break
            differs = [m for m in local.values() if m.get("differs")]
            if differs or time.monotonic() > deadline:
                raise RuntimeError(f"{t.name}: prompt counts not in-process: {local}")
            time.sleep(0.05)


def _check_answers(targets: list[Target], path: str, body: dict[str, object]) -> None:
    for t in targets:
        for stream in (False, True):
            req = urllib.request.Request(
                t.url + path,
                data=json.dumps({**body, "stream": stream}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                data = r.read()
            if stream:
                assert b"[DONE]" in data, (t.name, data[-200:])
            else:
                assert json.loads(data).get("choices"), (t.name, data[:200])


@dataclass
class Measured:
    latency: LoadResult
    best: LoadResult
    per_level: dict[int, LoadResult]
    cpu_cores: float


def _measure(
    t: Target, load: Any, path: str, body: dict[str, object], args: argparse.Namespace
) -> Measured:
    load(t.url + path, body, 4, 1)  # warm
    lat = load(t.url + path, body, 1, args.latency_seconds)
    per_level: dict[int, LoadResult] = {}
    best: LoadResult | None = None
    cpu = 0.0
    for conns in [int(c) for c in str(args.connections).split(",")]:
        c0 = cpu_seconds(t.proc.pid) if t.proc else 0.0
        t0 = time.monotonic()
        res = load(t.url + path, body, conns, args.throughput_seconds)
        per_level[conns] = res
        if best is None or res.requests_per_s > best.requests_per_s:
            best = res
            if t.proc:
                cpu = (cpu_seconds(t.proc.pid) - c0) / (time.monotonic() - t0)
    assert best is not None
    return Measured(lat, best, per_level, cpu)


def _print_table(title: str, results: dict[str, Measured]) -> None:
    direct = results[DIRECT].latency
    print(f"\n  {title}")
    header = (
        f"  {'target':30} {'p50 ms':>8} {'p99 ms':>8} {'p50 +ms':>8} {'p99 +ms':>8} "
        f"{'req/s':>9} {'failed':>7} {'cpu':>6} {'cpu ms/req':>10}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name, m in results.items():
        la, tp = m.latency, m.best
        is_direct = name == DIRECT
        added50 = "" if is_direct else f"{la.p50_ms - direct.p50_ms:8.3f}"
        added99 = "" if is_direct else f"{la.p99_ms - direct.p99_ms:8.3f}"
        failed = tp.non_2xx + tp.errors + la.non_2xx + la.errors
        cpu = "" if is_direct else f"{m.cpu_cores:5.2f}c"
        per_req = "" if is_direct or not tp.requests_per_s else f"{_cpu_ms(m):10.3f}"
        print(
            f"  {name:30} {la.p50_ms:8.3f} {la.p99_ms:8.3f} {added50:>8} {added99:>8} "
            f"{tp.requests_per_s:9.0f} {failed:7d} {cpu:>6} {per_req:>10}"
        )
    for name, m in results.items():
        cells = ", ".join(
            f"c={c}: {r.requests_per_s:.0f} ({r.non_2xx + r.errors} failed)"
            for c, r in m.per_level.items()
        )
        print(f"    {name:30} {cells}")


def _cpu_ms(m: Measured) -> float:
    """CPU milliseconds the proxy spent per request in its best throughput run: on a machine
    shared with other work, 1000 / this is what one worker does on a core of its own."""
    return m.cpu_cores / m.best.requests_per_s * 1000 if m.best.requests_per_s else float("nan")


def _row_verdict(name: str, m: Measured, direct: LoadResult) -> str:
    return (
        f"{name}, non-streamed: p50 added {m.latency.p50_ms - direct.p50_ms:.3f} ms, "
        f"p99 added {m.latency.p99_ms - direct.p99_ms:.3f} ms, "
        f"{m.best.requests_per_s:.0f} req/s; CPU {_cpu_ms(m):.3f} ms per request = "
        f"{1000 / _cpu_ms(m):.0f} req/s on a core of its own"
    )


def _verdicts(non_stream: dict[str, Measured]) -> list[str]:
    direct = non_stream[DIRECT].latency
    out = []
    g = non_stream.get(GUARD_EXACT)
    if g is not None:
        added = g.latency.p50_ms - direct.p50_ms
        out.append(
            f"targets for exact counts in-process: p50 added ≤ 0.5 ms: "
            f"{'yes' if added <= 0.5 else 'NO'}, ≥ 3,000 req/s: "
            f"{'yes' if g.best.requests_per_s >= 3000 else 'NO'}"
        )
    for name in (GUARD_EXACT, GUARD_REMOTE, GUARD_ESTIMATE, LITELLM):
        if name in non_stream:
            out.append(_row_verdict(name, non_stream[name], direct))
    if GUARD_REDIS in non_stream:
        r = non_stream[GUARD_REDIS]
        added99 = r.latency.p99_ms - direct.p99_ms
        out.append(
            f"guard + Redis, non-streamed: p99 added {added99:.3f} ms (≤ 2 ms: "
            f"{'yes' if added99 <= 2.0 else 'NO'}), p50 added "
            f"{r.latency.p50_ms - direct.p50_ms:.3f} ms, {r.best.requests_per_s:.0f} req/s"
        )
    return out


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
    ap.add_argument("--litellm-start-s", type=float, default=180.0)
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated parts of target names to run (e.g. 'in-process,/tokenize,"
        "estimated,litellm'); the direct row always runs",
    )
    ap.add_argument("--no-streamed", action="store_true", help="skip the streamed runs")
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
    load_before = os.getloadavg()
    procs: list[subprocess.Popen[bytes]] = []
    workdir = Path(tempfile.mkdtemp(prefix="guard-overhead-"))
    redis_server: Any = None
    try:
        targets, notes, redis_server = _start_targets(args, workdir, procs)
        _check_answers(targets, path, body)
        _wait_in_process_counts(targets, path, body)
        non_stream = {
            t.name: _measure(t, load, path, {**body, "stream": False}, args) for t in targets
        }
        streamed = {
            t.name: _measure(t, load, path, {**body, "stream": True}, args)
            for t in targets
            if not args.no_streamed
        }
    finally:
        for p in reversed(procs):
            stop(p)
        if redis_server is not None:
            redis_server.stop()

    print("\nguard overhead benchmark (loopback)")
    print(
        f"  machine: {os.cpu_count()} cores (shared), load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; python {sys.version.split()[0]}"
    )
    print(f"  endpoint: POST {path}  body: {json.dumps(body)}")
    print(f"  load generator: {loadgen_name}")
    print(
        f"  latency: 1 connection, back to back, {args.latency_seconds} s per target; "
        f"throughput: {args.connections} connections, {args.throughput_seconds} s per target"
    )
    print("  each proxy: one worker process; upstream: bench/_upstream.py (canned answers)")
    cost = count_cost_us(_model_dir(workdir), body)
    print(
        f"  one prompt count, CPU in-process: {cost['in-process']:.1f} µs with the model's "
        f"tokenizer and chat template, {cost['estimate']:.1f} µs estimated"
    )
    _print_table("non-streamed", non_stream)
    if streamed:
        _print_table("streamed (to the end of the stream)", streamed)
    for note in notes:
        print(f"\n  {note}")
    print()
    for line in _verdicts(non_stream):
        print(f"  {line}")
    print(
        "  cpu = cores the proxy process used during its best throughput run; cpu ms/req = "
        "its CPU time per request there"
    )
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
