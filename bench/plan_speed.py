"""Wall time of one `oomguard plan` from a cold interpreter, best of N (target: under 0.4 s).

Runs ``oomguard plan meta-llama/Llama-3.1-70B-Instruct --gpu "RTX 4090" --p99-tokens 8192
--concurrency 16`` (the README's quick start: 70B does not fit, so the search, the alternatives
and llama.cpp's split are all computed) as a fresh process each time, interpreter start and
imports included, and prints every run, the best, and the conditions: CPU count and the load
average before and after. Offline (``HF_HUB_OFFLINE=1``) and with an empty calibration store,
so nothing but planning is timed.

Usage: python bench/plan_speed.py [--runs 5] [--target 0.4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND = ["plan", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "RTX 4090",
           "--p99-tokens", "8192", "--concurrency", "16"]  # fmt: skip


def _entry_point() -> list[str]:
    """The installed ``oomguard`` script beside this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("oomguard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "oomguard.cli"]


def time_once(env: dict[str, str]) -> float:
    """Seconds one cold `oomguard plan` takes, start to exit (its exit code 1 is expected)."""
    started = time.perf_counter()
    proc = subprocess.run(
        [*_entry_point(), *COMMAND], capture_output=True, text=True, env=env, timeout=120
    )
    elapsed = time.perf_counter() - started
    if proc.returncode not in (0, 1) or "Traceback" in proc.stderr:
        raise SystemExit(f"plan failed (exit {proc.returncode}): {proc.stderr.strip()[:300]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.4, help="seconds")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OOMGUARD_HOME": home, "COLUMNS": "100"}
        time_once(env)  # warm the OS page cache and .pyc files, as any second run would be
        load_before = os.getloadavg()
        times = [time_once(env) for _ in range(args.runs)]
        load_after = os.getloadavg()
    print(f"command: oomguard {' '.join(COMMAND)}")
    print(f"runs: {', '.join(f'{t:.3f}' for t in times)} s")
    best = min(times)
    verdict = "met" if best < args.target else "NOT met"
    print(f"best of {args.runs}: {best:.3f} s (target < {args.target} s: {verdict})")
    print(f"conditions: {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; Python {sys.version.split()[0]}")  # fmt: skip
    return 0 if best < args.target else 1


if __name__ == "__main__":
    sys.exit(main())
