"""One round of samples: every server's ``/metrics``, NVML per GPU and per process, host memory.

A *target* is what the watcher follows: a vLLM server (its URL, and the processes behind it
when they run on this host) or a bare process (``--pid`` without a URL). Each round yields a
:class:`TargetSample` per target, and the GPUs' figures once (they belong to the host).

GPU memory of a target comes from NVML's per-process figures where NVML lists the target's
processes. Inside a container NVML reports host PIDs, so none of ours match, and some drivers
report wrong per-process figures; then, when this host runs a single target, the whole
device's used memory stands in, and the sample says so (``gpu_source``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import psutil

from oomguard import vllm_metrics as vm
from oomguard.engine.memory import DeviceMemory, gpu_memory, host_rss_bytes, process_tree
from oomguard.errors import BadInput
from oomguard.vllm_metrics import VllmSnapshot, parse_vllm_metrics

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


# The series the watcher reads, by their exposed names (counters carry ``_total``). A page
# holds hundreds of lines (histograms, ``_created`` twins); handing only these to the parser
# keeps a round over several servers well under 1 % of a core.
_WANTED_SAMPLES = frozenset({
    vm.KV_USAGE, vm.KV_USAGE_LEGACY, vm.PREEMPTIONS + "_total", vm.RUNNING, vm.WAITING,
    vm.WAITING_BY_REASON, vm.CACHE_CONFIG, vm.SLEEP_STATE, vm.PREFIX_CACHE_QUERIES + "_total",
    vm.PREFIX_CACHE_HITS + "_total", vm.REQUEST_SUCCESS + "_total",
})  # fmt: skip


def watched_lines(text: str) -> str:
    """The lines of a ``/metrics`` page that carry the series the watcher reads."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[2] in _WANTED_SAMPLES:
                kept.append(line)
            continue
        end = line.find("{")
        name = line[:end] if end >= 0 else line.split(" ", 1)[0]
        if name in _WANTED_SAMPLES:
            kept.append(line)
    return "\n".join(kept) + "\n"


def normalise_url(raw: str) -> tuple[str, str]:
    """(base URL, metrics URL) of a server given as ``host:port``, ``http://host:port`` or a
    full ``…/metrics`` address. Anything else is a one-line BadInput."""
    text = raw.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(
            f"{raw!r} is not a server address",
            "pass the vLLM server's URL, e.g. http://127.0.0.1:8000",
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise BadInput(f"{raw!r} has a bad port", "pass e.g. http://127.0.0.1:8000") from exc
    netloc = parts.netloc
    path = parts.path.rstrip("/")
    if path.endswith("/metrics"):
        path = path[: -len("/metrics")]
    base = f"{parts.scheme}://{netloc}{path}"
    del port
    return base, base + "/metrics"


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, or one of its own addresses)."""
    if host.lower() in _LOCAL_NAMES or host.lower() == socket.gethostname().lower():
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if address.is_loopback or address.is_unspecified:
        return True
    own = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return str(address) in own


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this host (the lowest PID if several)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    pids = [
        c.pid
        for c in conns
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
    ]
    return min(pids) if pids else None


@dataclass(frozen=True)
class GpuShare:
    """What one target holds on one GPU."""

    index: int
    used_bytes: int  # the target's processes (per-process) or the whole device's used memory
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class TargetSample:
    """One target at one moment. ``up`` is False when it did not answer (``error`` says why)."""

    name: str
    at_s: float
    up: bool
    error: str = ""
    not_vllm: bool = False  # answered, but with no vLLM metric
    snapshot: VllmSnapshot | None = None
    pids: tuple[int, ...] = ()
    host_rss_bytes: int | None = None
    gpus: tuple[GpuShare, ...] = ()
    gpu_source: str = "none"  # "nvml-process" | "nvml-device" | "none"
    gpu_note: str = ""
    scrape_s: float = 0.0


@dataclass
class Target:
    """A server or process being watched, and what was learned about it so far."""

    name: str
    metrics_url: str | None = None
    given_pid: int | None = None
    local: bool = False
    port: int | None = None
    engine_pid: int | None = None
    seen_vllm: bool = False
    notes: list[str] = field(default_factory=list)
    _tree: tuple[int, ...] = ()
    _tree_at_s: float = -1e9

    TREE_REFRESH_S = 10.0  # the engine's processes rarely change; listing them reads all of /proc

    @classmethod
    def for_url(cls, raw: str, pid: int | None = None) -> Target:
        """A target for a server URL (and optionally its PID)."""
        base, metrics = normalise_url(raw)
        parts = urlsplit(base)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        local = is_local_host(parts.hostname or "")
        return cls(
            name=base, metrics_url=metrics, given_pid=pid, local=local or pid is not None, port=port
        )

    @classmethod
    def for_pid(cls, pid: int) -> Target:
        """A target that is a bare process on this host."""
        if not psutil.pid_exists(pid):
            raise BadInput(f"no process with PID {pid}", "pass the PID of a running process")
        return cls(name=f"pid:{pid}", given_pid=pid, local=True)

    def pids(self, now_s: float | None = None) -> tuple[int, ...]:
        """The target's processes (its root and every descendant), if known.

        Listed again every ``TREE_REFRESH_S`` seconds, or at once when one of them is gone.
        """
        now_s = time.monotonic() if now_s is None else now_s
        fresh = now_s - self._tree_at_s < self.TREE_REFRESH_S
        if fresh and all(psutil.pid_exists(p) for p in self._tree):
            return self._tree
        root = self.given_pid
        if root is None and self.local and self.port is not None:
            if self.engine_pid is None or not psutil.pid_exists(self.engine_pid):
                self.engine_pid = listening_pid(self.port)
            root = self.engine_pid
        self._tree = tuple(process_tree(root)) if root is not None else ()
        self._tree_at_s = now_s
        return self._tree


class GpuReader:
    """NVML per GPU, once a round; stops asking after NVML turned out to be absent."""

    def __init__(self) -> None:
        self.available: bool | None = None

    def read(self) -> list[DeviceMemory] | None:
        """Every GPU's memory and per-process use, or None without NVML."""
        if self.available is False:
            return None
        devices = gpu_memory()
        if self.available is None:
            self.available = devices is not None
        return devices


def gpu_shares(
    pids: tuple[int, ...], devices: list[DeviceMemory] | None, single_local_target: bool
) -> tuple[tuple[GpuShare, ...], str, str]:
    """(shares, source, note) of a target's processes on each GPU.

    Per-process figures where NVML lists one of ``pids``; otherwise, when this host runs a
    single target, the whole devices' used memory, with a note saying why.
    """
    if not devices:
        return (), "none", ""
    wanted = set(pids)
    per_process = [
        GpuShare(
            d.index,
            sum(b for p, b in d.process_bytes.items() if p in wanted),
            d.total_bytes,
            d.free_bytes,
        )
        for d in devices
        if wanted & set(d.process_bytes)
    ]
    if per_process:
        return tuple(per_process), "nvml-process", ""
    if not single_local_target:
        return (), "none", "NVML lists none of its processes; several targets share the GPUs"
    why = (
        "NVML lists none of its processes (inside a container NVML reports host PIDs)"
        if pids
        else "its processes are unknown (pass --pid)"
    )
    shares = tuple(GpuShare(d.index, d.used_bytes, d.total_bytes, d.free_bytes) for d in devices)
    return shares, "nvml-device", f"{why}: whole-device figures"


async def scrape(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[VllmSnapshot | None, str, bool]:
    """(snapshot, error, not_vllm) for one ``/metrics`` fetch."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text(errors="replace")
            status = resp.status
    except asyncio.TimeoutError:
        return None, f"no answer within {timeout_s:g} s", False
    except aiohttp.ClientError as exc:
        return None, _short_error(exc), False
    if status >= 500:
        return None, f"HTTP {status}", False
    if status != 200:
        return None, f"/metrics answered HTTP {status}", True
    try:
        snap = parse_vllm_metrics(watched_lines(text))
    except ValueError:
        return None, "/metrics is not in Prometheus text format", True
    if not snap.is_vllm:
        guard = "oomguard_backend_healthy" in text
        what = (
            "it is an oomguard guard: watch the vLLM servers behind it"
            if guard
            else "its /metrics has no vllm: metric"
        )
        return None, what, True
    return snap, "", False


def _short_error(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        why = os.strerror(err.errno) if err.errno else (err.strerror or str(err))
        return f"cannot connect: {why.lower()}"
    return f"{type(exc).__name__}: {exc}"[:200]


async def sample_target(
    target: Target,
    session: aiohttp.ClientSession,
    devices: list[DeviceMemory] | None,
    single_local_target: bool,
    timeout_s: float,
) -> TargetSample:
    """One sample of ``target`` (its metrics, its processes' host and GPU memory)."""
    at_s = time.time()
    started = time.perf_counter()
    snapshot, error, not_vllm = None, "", False
    if target.metrics_url is not None:
        snapshot, error, not_vllm = await scrape(session, target.metrics_url, timeout_s)
    scrape_s = time.perf_counter() - started
    pids = target.pids() if target.local else ()
    if target.metrics_url is None and not pids:
        error = "the process has exited"
    up = not error
    rss = host_rss_bytes(pids) if pids else None
    shares, source, note = gpu_shares(pids, devices, single_local_target)
    return TargetSample(
        name=target.name,
        at_s=at_s,
        up=up,
        error=error,
        not_vllm=not_vllm,
        snapshot=snapshot,
        pids=pids,
        host_rss_bytes=rss or None,
        gpus=shares,
        gpu_source=source,
        gpu_note=note,
        scrape_s=scrape_s,
    )
