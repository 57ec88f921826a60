"""The checks only a machine with an NVIDIA GPU can make (run through scripts/gpu-check.sh).

It needs PyTorch with CUDA, nvidia-ml-py and oomguard's own runtime modules; nothing is
downloaded and vLLM is not used. A co-tenant process (PyTorch) holds GPU memory while
oomguard's faces look at the device:

1. NVML's free memory against ``torch.cuda.mem_get_info`` (and the total CUDA reports against
   the GPU catalogue's, which ``plan`` uses as vLLM's total);
2. ``oomguard plan --gpu auto`` before and while the co-tenant holds memory: the free memory it
   plans with, and a utilization whose request fits in what is free (vLLM's startup check);
3. ``oomguard watch --pid`` of the co-tenant: its per-process GPU memory;
4. the wait serve makes before relaunching: memory is reported released only after the
   co-tenant has freed its CUDA memory and exited, and the device is back to its level.

Exit codes: 0 every check passed (warnings allowed), 1 a check failed, 2 a module is missing,
3 no NVIDIA GPU. ``--json FILE`` writes every measured figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen3-8B"  # in the catalogue: plan runs offline
WORKLOAD = ["--p99-tokens", "8192", "--concurrency", "8"]

# module → what provides it; plan needs typer, rich, yaml, pynvml; watch adds the rest
MODULES = {
    "torch": "PyTorch with CUDA",
    "pynvml": "nvidia-ml-py",
    "typer": "typer",
    "rich": "rich",
    "yaml": "pyyaml",
    "numpy": "numpy",
    "psutil": "psutil",
    "aiohttp": "aiohttp",
    "prometheus_client": "prometheus-client",
}

COTENANT = """
import sys, torch
held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
held.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "exit":
        break
del held
torch.cuda.empty_cache()
torch.cuda.synchronize()
"""

TORCH_VS_NVML = """
import json, pynvml, torch
torch.cuda.init()
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
before = pynvml.nvmlDeviceGetMemoryInfo(handle)
free_t, total_t = torch.cuda.mem_get_info(0)
after = pynvml.nvmlDeviceGetMemoryInfo(handle)
try:
    reserved = int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).reserved)
except Exception:
    reserved = 0
name = pynvml.nvmlDeviceGetName(handle)
print(json.dumps({
    "name": name.decode() if isinstance(name, bytes) else str(name),
    "nvml_total_bytes": int(before.total), "nvml_reserved_bytes": reserved,
    "nvml_free_bytes": (int(before.free) + int(after.free)) // 2,
    "torch_free_bytes": int(free_t), "torch_total_bytes": int(total_t),
}))
"""


@dataclass
class Check:
    """One check's verdict and the figures behind it."""

    name: str
    status: str = "PASS"  # PASS, WARN or FAIL
    detail: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def expect(self, ok: bool, what: str, *, warn_only: bool = False) -> None:
        """Record ``what``; a false ``ok`` fails the check (or warns)."""
        if ok:
            self.detail.append(what)
            return
        self.detail.append(f"NOT {what}")
        if warn_only:
            self.status = "WARN" if self.status == "PASS" else self.status
        else:
            self.status = "FAIL"


def _env() -> dict[str, str]:
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")  # CUDA's device 0 is NVML's 0
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO / "src"), env.get("PYTHONPATH")] if p)
    return env


def oomguard(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the oomguard CLI from this checkout with this interpreter."""
    code = "import sys; from oomguard.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=_env(),
        text=True,
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )


def nvml_used_bytes() -> dict[int, int]:
    """Used memory of every device, by NVML index, as serve reads it before a launch."""
    from oomguard.engine import gpu_memory

    return {d.index: d.used_bytes for d in gpu_memory() or []}


def nvml_free_bytes(index: int = 0) -> int:
    """Free memory of one device as NVML reports it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
    finally:
        pynvml.nvmlShutdown()


def wait_settled(timeout_s: float = 10.0) -> dict[int, int]:
    """NVML's used memory once two reads 0.2 s apart agree within 16 MiB (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    last = nvml_used_bytes()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = nvml_used_bytes()
        if all(abs(now[i] - last.get(i, 0)) <= 16 * MIB for i in now):
            return now
        last = now
    return last


class CoTenant:
    """A PyTorch process holding ``nbytes`` of GPU memory until told to free it and exit."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.proc = subprocess.Popen(
            [sys.executable, "-c", COTENANT, str(nbytes)],
            env=_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"the co-tenant did not allocate {nbytes / GIB:.1f} GiB: {line!r}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def free_and_exit(self) -> None:
        """Tell it to free its CUDA memory and exit (does not wait)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("exit\n")
        self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def check_torch_vs_nvml() -> Check:
    """NVML's free memory against cudaMemGetInfo's, and CUDA's total against the catalogue."""
    check = Check("nvml-vs-torch")
    run = subprocess.run(
        [sys.executable, "-c", TORCH_VS_NVML],
        env=_env(),
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    if run.returncode != 0:
        check.expect(False, f"torch and NVML read the device ({run.stderr.strip()[-300:]})")
        return check
    f = json.loads(run.stdout)
    from oomguard.facts import detect_gpus

    spec = detect_gpus()[0].spec  # what plan --gpu auto plans with
    f["plan_gpu_name"], f["plan_total_bytes"], f["plan_total_source"] = (
        spec.name,
        spec.total_bytes,
        spec.source,
    )
    check.figures = f
    free_diff = f["nvml_free_bytes"] - f["torch_free_bytes"]
    check.expect(
        abs(free_diff) <= 256 * MIB,
        f"NVML free {f['nvml_free_bytes'] / GIB:.2f} GiB = torch free "
        f"{f['torch_free_bytes'] / GIB:.2f} GiB within 256 MiB ({free_diff / MIB:+.0f} MiB)",
    )
    total_diff = spec.total_bytes / f["torch_total_bytes"] - 1
    check.expect(
        abs(total_diff) <= 0.01,
        f"plan's total for {spec.name} ({spec.source}) {spec.total_bytes / GIB:.2f} GiB = CUDA "
        f"total {f['torch_total_bytes'] / GIB:.2f} GiB within 1 % ({total_diff:+.2%})",
    )
    check.detail.append(
        f"NVML total {f['nvml_total_bytes'] / GIB:.2f} GiB, reserved "
        f"{f['nvml_reserved_bytes'] / MIB:.0f} MiB"
    )
    return check


def plan_auto() -> tuple[dict[str, Any] | None, str]:
    """``oomguard plan MODEL --gpu auto`` with a workload, as JSON (or None and the error)."""
    run = oomguard("plan", MODEL, "--gpu", "auto", *WORKLOAD, "--json")
    if run.returncode not in (0, 1):
        return None, f"exit {run.returncode}: {run.stderr.strip()[-300:]}"
    return json.loads(run.stdout), ""


def check_plan_auto(baseline: dict[str, Any], cotenant: CoTenant) -> Check:
    """plan --gpu auto while the co-tenant holds memory: NVML's free memory, a request that fits."""
    check = Check("plan-gpu-auto")
    free_now = nvml_free_bytes()
    shared, error = plan_auto()
    if shared is None:
        check.expect(False, f"plan --gpu auto runs with a co-tenant ({error})")
        return check
    gpu, settings = shared["gpu"], shared["settings"]
    drop_gib = baseline["gpu"]["free_gib"] - gpu["free_gib"]
    check.figures = {
        "alone": baseline["gpu"],
        "with_cotenant": gpu,
        "settings": settings,
        "cotenant_gib": cotenant.nbytes / GIB,
        "nvml_free_gib": free_now / GIB,
    }
    check.expect(gpu["source"] == "nvml", f"the GPU comes from NVML (source {gpu['source']!r})")
    kept_gib = free_now / GIB - gpu["free_gib"]  # plan keeps room for vLLM's own CUDA context
    check.expect(
        0.0 <= kept_gib <= 1.0,
        f"plan's free {gpu['free_gib']:.2f} GiB is NVML's {free_now / GIB:.2f} GiB less at most "
        f"1 GiB for vLLM's CUDA context ({kept_gib:.2f} GiB)",
    )
    low, high = cotenant.nbytes / GIB - 0.25, cotenant.nbytes / GIB + 2.0
    check.expect(
        low <= drop_gib <= high,
        f"free memory dropped by the co-tenant's {cotenant.nbytes / GIB:.1f} GiB "
        f"(+ its CUDA context): {drop_gib:.2f} GiB",
    )
    requested = settings["gpu_memory_utilization"] * shared["memory"]["total_gib"]
    check.expect(
        requested <= gpu["free_gib"],
        f"the planned request {settings['gpu_memory_utilization']} × "
        f"{shared['memory']['total_gib']} = {requested:.2f} GiB fits in the "
        f"{gpu['free_gib']:.2f} GiB free (vLLM's startup check)",
    )
    check.expect(bool(shared["fits"]), f"{MODEL} still serves the workload ({shared['problems']})")
    return check


def check_watch(cotenant: CoTenant) -> Check:
    """watch --pid of the co-tenant reports its GPU memory per process."""
    check = Check("watch-per-process")
    run = oomguard("watch", "--pid", str(cotenant.pid), "--once", "--json", "--interval", "1")
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    status = next((e for e in events if e.get("event") == "status"), None)
    if status is None:
        check.expect(False, f"watch prints a status (exit {run.returncode}: {run.stderr[-300:]})")
        return check
    server = status["servers"][0]
    held = sum(g["used_bytes"] for g in server["gpus"])
    check.figures = {"exit_code": run.returncode, "server": server, "devices": status["gpus"]}
    check.expect(run.returncode == 0, f"watch --once exits 0 (healthy): {run.returncode}")
    per_process = server["gpu_source"] == "nvml-process"
    check.expect(
        per_process,
        f"NVML lists the co-tenant's pid (source {server['gpu_source']!r}; "
        f"{server['gpu_note'] or 'no note'})",
        warn_only=True,
    )
    if per_process:
        check.expect(
            cotenant.nbytes <= held <= cotenant.nbytes + 2 * GIB,
            f"the co-tenant holds {held / GIB:.2f} GiB: its {cotenant.nbytes / GIB:.1f} GiB "
            "and a CUDA context under 2 GiB",
        )
    else:
        check.expect(
            held >= cotenant.nbytes,
            f"the whole device holds {held / GIB:.2f} GiB, at least the co-tenant's "
            f"{cotenant.nbytes / GIB:.1f} GiB",
        )
    return check


def check_release(cotenant: CoTenant, used_before: dict[int, int]) -> Check:
    """serve's wait: released only once the co-tenant has freed its memory and exited."""
    from oomguard.engine import wait_memory_released

    check = Check("serve-wait-release")
    early = wait_memory_released([cotenant.pid], timeout_s=2.0, used_before_start=used_before)
    check.expect(
        not early.released, f"not released while the process lives ({early.source}: {early.detail})"
    )
    cotenant.free_and_exit()
    started = time.monotonic()
    release = wait_memory_released([cotenant.pid], timeout_s=60.0, used_before_start=used_before)
    waited_s = time.monotonic() - started
    try:
        cotenant.proc.wait(timeout=5)
        exited = True
    except subprocess.TimeoutExpired:
        exited = False
    used_after = nvml_used_bytes()
    excess = max(used_after[i] - used_before.get(i, used_after[i]) for i in used_after)
    check.figures = {
        "released": release.released,
        "waited_s": round(waited_s, 3),
        "source": release.source,
        "detail": release.detail,
        "excess_used_mib": excess / MIB,
    }
    check.expect(
        release.released, f"released after {waited_s:.2f} s ({release.source}: {release.detail})"
    )
    check.expect(exited, "the co-tenant had exited")
    check.expect(
        excess <= 256 * MIB,
        f"every device back to its level before the co-tenant ({excess / MIB:+.0f} MiB)",
    )
    return check


def cotenant_bytes(total_bytes: int, requested_gib: float | None) -> int:
    """What the co-tenant holds: the given GiB, or a third of the device up to 40 GiB."""
    if requested_gib is not None:
        return int(requested_gib * GIB)
    return int(min(40 * GIB, total_bytes // 3))


def run_checks(requested_gib: float | None) -> list[Check]:
    """Every check, in order; the co-tenant is stopped whatever happens."""
    checks = [check_torch_vs_nvml()]
    used_before = wait_settled()  # the torch process above has let go of its context
    baseline, error = plan_auto()
    if baseline is None or baseline["gpu"].get("free_gib") is None:
        failed = Check("plan-gpu-auto")
        why = error if baseline is None else f"the GPU came from {baseline['gpu'].get('source')!r}"
        failed.expect(False, f"plan --gpu auto reads this machine's GPU through NVML ({why})")
        return [*checks, failed]
    total = int(checks[0].figures.get("torch_total_bytes") or baseline["gpu"]["total_gib"] * GIB)
    try:
        cotenant = CoTenant(cotenant_bytes(total, requested_gib))
    except RuntimeError as exc:
        failed = Check("cotenant")
        failed.expect(False, str(exc))
        return [*checks, failed]
    try:
        checks.append(check_plan_auto(baseline, cotenant))
        checks.append(check_watch(cotenant))
        checks.append(check_release(cotenant, used_before))
    finally:
        cotenant.kill()
    return checks


def main(argv: list[str] | None = None) -> int:
    """Run the checks and print one verdict line per check; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cotenant-gib",
        type=float,
        default=None,
        help="GPU memory the co-tenant holds (default: a third, at most 40 GiB)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure to FILE")
    args = parser.parse_args(argv)
    missing = [f"{m} ({pkg})" for m, pkg in MODULES.items() if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"gpu-check: missing modules: {', '.join(missing)}; PyTorch with CUDA and "
            "nvidia-ml-py must be in this python (set PYTHON=...), oomguard's own modules can "
            "come from OOMGUARD_GPU_CHECK_DEPS=DIR (bash scripts/gpu-check.sh --prepare DIR)",
            file=sys.stderr,
        )
        return 2
    if nvml_device_count() == 0:
        print("gpu-check: NVML sees no NVIDIA GPU on this machine", file=sys.stderr)
        return 3
    started = time.monotonic()
    checks = run_checks(args.cotenant_gib)
    for c in checks:
        print(f"{c.status} {c.name}: " + "; ".join(c.detail))
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(
        f"gpu-check: {len(checks) - len(failed)} of {len(checks)} checks passed in "
        f"{time.monotonic() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(c) for c in checks], indent=2, default=str))
    return 1 if failed else 0


def nvml_device_count() -> int:
    """Devices NVML sees; 0 when the driver or its library is absent."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU to check
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
