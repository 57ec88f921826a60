"""The guard's Redis-loss scenario, soaked: the same real test run N times in one session.

Each run is ``tests/integration/test_guard_real.py::test_three_replicas_on_redis_share_one_backend``
against the session's one real vLLM (CPU): three guard replicas share one backend through a
Redis ledger, Redis is killed mid-burst and restarted empty, and a replica is SIGKILLed while
its requests hold leases. A run passes only with 0 preemptions in vLLM's own counter and every
request answered (the test's assertions). The script prints one line per run and the tally,
with the machine's load average, so it can be run beside other work to soak it under load.

    python bench/guard_redis_soak.py --runs 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/integration/test_guard_real.py::test_three_replicas_on_redis_share_one_backend"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="how many times to run the scenario")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    report = Path(tempfile.mkdtemp(prefix="oomguard-soak-")) / "junit.xml"
    load_before = os.getloadavg()
    started = time.monotonic()
    cmd = [
        *(sys.executable, "-m", "pytest", "-q"),
        *(f"--count={args.runs}", "--repeat-scope=function", f"--junitxml={report}", TEST),
    ]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, check=False)
    wall_s = time.monotonic() - started
    if not report.exists():
        print(f"pytest wrote no report (exit {proc.returncode})", file=sys.stderr)
        return 2
    cases = list(ET.parse(report).getroot().iter("testcase"))
    if proc.returncode not in (0, 1) and cases:
        # interrupted: the run that was cut short is in the report without an outcome
        print(f"pytest stopped early (exit {proc.returncode}); the last run is not counted")
        cases = cases[:-1]
    passed = failed = 0
    for i, case in enumerate(cases, 1):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        ok = problem is None and case.find("skipped") is None
        passed += ok
        failed += not ok
        why = "" if ok else f": {(problem.get('message') if problem is not None else 'skipped')}"
        print(f"run {i:2d}: {'pass' if ok else 'FAIL'} in {float(case.get('time', 0)):.0f} s{why}")
    load_after = os.getloadavg()
    print(
        f"\n{passed} of {passed + failed} runs with 0 preemptions and every request answered; "
        f"{wall_s / 60:.1f} min on {os.cpu_count()} cores, load average {load_before[0]:.1f} "
        f"before, {load_after[0]:.1f} after"
    )
    return 0 if failed == 0 and passed == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
