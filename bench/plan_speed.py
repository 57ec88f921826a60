"""Wall time of one `oomguard plan` from a cold interpreter, best of N (target: under 0.4 s).

Runs ``oomguard plan meta-llama/Llama-3.1-70B-Instruct --gpu "RTX 4090" --p99-tokens 8192
--concurrency 16`` (the README's quick start: 70B does not fit, so the search, the alternatives
and llama.cpp's split are all computed) as a fresh process each time, interpreter start and
imports included, and prints every run, the best, and the conditions: CPU count and the load
average before and after. Offline (``HF_HUB_OFFLINE=1``) and with an empty calibration store,
so nothing but planning is timed.

``--write-docs`` writes the result into the plan-speed section of ``docs/accuracy.md``.

Usage: python bench/plan_speed.py [--runs 5] [--target 0.4] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy_page  # noqa: E402 - bench helper beside this file

COMMAND = ["plan", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "RTX 4090",
           "--p99-tokens", "8192", "--concurrency", "16"]  # fmt: skip


def _entry_point() -> list[str]:
    """The installed ``oomguard`` script beside this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("oomguard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "oomguard.cli"]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_once(env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one cold `oomguard plan`, start to exit (exit code 1 —
    the model does not fit — is expected). On a loaded machine the wall time includes waiting
    for a core; the CPU time (user + system) is what the run costs on an idle one."""
    cpu_before = _children_cpu_s()
    started = time.perf_counter()
    proc = subprocess.run(
        [*_entry_point(), *COMMAND], capture_output=True, text=True, env=env, timeout=120
    )
    elapsed = time.perf_counter() - started
    if proc.returncode not in (0, 1) or "Traceback" in proc.stderr:
        raise SystemExit(f"plan failed (exit {proc.returncode}): {proc.stderr.strip()[:300]}")
    return elapsed, _children_cpu_s() - cpu_before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.4, help="seconds")
    ap.add_argument("--write-docs", action="store_true", help="write the plan-speed section")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OOMGUARD_HOME": home, "COLUMNS": "100"}
        # the warm-up writes the .pyc files, which a PYTHONDONTWRITEBYTECODE inherited from the
        # shell forbids: every run would then compile the sources again, as no installed copy does
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        time_once(env)  # warm the OS page cache and .pyc files, as any second run would be
        load_before = os.getloadavg()
        runs = [time_once(env) for _ in range(args.runs)]
        load_after = os.getloadavg()
    times = [wall for wall, _ in runs]
    print(f"command: oomguard {' '.join(COMMAND)}")
    print(f"runs (wall): {', '.join(f'{t:.3f}' for t in times)} s")
    print(f"runs (CPU, user + system): {', '.join(f'{c:.3f}' for _, c in runs)} s")
    best = min(times)
    verdict = "met" if best < args.target else "NOT met"
    print(
        f"best of {args.runs}: {best:.3f} s wall (target < {args.target} s: {verdict}); "
        f"best CPU time {min(c for _, c in runs):.3f} s"
    )
    print(
        f"conditions: {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; Python {sys.version.split()[0]}"
    )
    if load_before[0] > (os.cpu_count() or 1):
        print(
            "the machine was loaded (load average above its CPU count): the wall time "
            "includes waiting for a core; measure on a quiet machine for the target"
        )
    if args.write_docs:
        body = speed_markdown(runs, args.target, load_before[0], load_after[0])
        accuracy_page.write_section("plan-speed", body, "python bench/plan_speed.py --write-docs")
    return 0 if best < args.target else 1


def speed_markdown(
    runs: list[tuple[float, float]], target: float, before: float, after: float
) -> str:
    """The plan-speed section of the accuracy page."""
    best, cpu = min(wall for wall, _ in runs), min(c for _, c in runs)
    loaded = before > (os.cpu_count() or 1)
    return "\n".join(
        [
            f"`oomguard {shlex.join(COMMAND)}` from a cold interpreter (70B does not fit, so the",
            "search, the alternatives and llama.cpp's split are all computed), "
            "offline, with an empty",
            "calibration store:",
            "",
            f"- best of {len(runs)}: **{best:.3f} s wall** (target under {target} s: "
            f"{'met' if best < target else 'NOT met'}), {cpu:.3f} s of CPU time",
            f"- every run (wall): {', '.join(f'{w:.3f}' for w, _ in runs)} s",
            f"- load average {before:.1f} before, {after:.1f} after, on {os.cpu_count()} CPUs"
            + (
                "; the machine was loaded, so the wall time includes waiting for a core and the "
                "CPU time is what a run costs on an idle one"
                if loaded
                else ""
            ),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
