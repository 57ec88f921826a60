"""Find llama-server, run it on a model through :class:`~oomguard.engine.EngineProcess`, read its
load.

The binary is, in order: ``$OOMGUARD_LLAMA_SERVER``, the build that
``scripts/setup-llama-server.sh`` caches under ``~/.cache/oomguard/llama.cpp/<version>/bin``
(``$OOMGUARD_CACHE`` moves it), or ``llama-server`` on ``PATH``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from oomguard.engine import EngineProcess
from oomguard.errors import BadInput, EngineFailed, EnvironmentProblem
from oomguard.tiering.args import FlagTable, parse_help
from oomguard.tiering.command import llama_server_argv
from oomguard.tiering.loadlog import LoadLog
from oomguard.tiering.settings import LlamaCppSettings
from oomguard.units import GIB, MIB


class LlamaServerNotFound(EnvironmentProblem):
    """No llama-server binary was found."""


class LlamaServerFailed(EngineFailed):
    """llama-server exited or never became healthy while loading."""

    def __init__(self, message: str, hint: str, load_log: LoadLog, tail: list[str]) -> None:
        super().__init__(message, hint)
        self.load_log = load_log
        self.tail = tail


def cache_root() -> Path:
    """Where built engines are cached (``$OOMGUARD_CACHE`` or ``~/.cache/oomguard``)."""
    return Path(os.environ.get("OOMGUARD_CACHE") or Path.home() / ".cache" / "oomguard")


def _cached_binaries(name: str) -> list[Path]:
    root = cache_root() / "llama.cpp"
    if not root.is_dir():
        return []
    found = [d / "bin" / name for d in root.iterdir() if (d / "bin" / name).is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find_llama_server(name: str = "llama-server") -> Path:
    """The llama-server (or ``rpc-server``) to run; :class:`LlamaServerNotFound` if none."""
    env = os.environ.get("OOMGUARD_LLAMA_SERVER")
    if env and name == "llama-server":
        path = Path(env).expanduser()
        if not path.is_file():
            raise LlamaServerNotFound(
                f"$OOMGUARD_LLAMA_SERVER={env} is not a file", "point it at a llama-server binary"
            )
        return path
    if env and name != "llama-server" and (Path(env).parent / name).is_file():
        return Path(env).parent / name
    cached = _cached_binaries(name)
    if cached:
        return cached[0]
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise LlamaServerNotFound(
        f"{name} not found",
        "build it with scripts/setup-llama-server.sh or set $OOMGUARD_LLAMA_SERVER",
    )


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class SlotCapacity:
    """What llama-server's ``/props`` says about capacity: slots and the context of each."""

    total_slots: int
    n_ctx_per_slot: int

    @property
    def tokens(self) -> int:
        """Tokens all slots hold at once."""
        return self.total_slots * self.n_ctx_per_slot


def slot_capacity(props: dict[str, object]) -> SlotCapacity:
    """Read :class:`SlotCapacity` from a ``/props`` answer (``total_slots``,
    ``default_generation_settings.n_ctx``); BadInput when they are missing."""
    settings = props.get("default_generation_settings")
    slots = props.get("total_slots")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    if not isinstance(slots, int) or not isinstance(n_ctx, int):
        raise BadInput(
            "llama-server's /props lacks total_slots or default_generation_settings.n_ctx",
            "check that the URL is a llama-server",
        )
    return SlotCapacity(slots, n_ctx)


@dataclass
class RunningLlamaServer:
    """A healthy llama-server: where it answers, its process and what it printed while loading."""

    url: str
    process: EngineProcess
    load_log: LoadLog
    argv: list[str]


@contextmanager
def running_llama_server(
    model_path: str | Path,
    settings: LlamaCppSettings,
    *,
    binary: Path | None = None,
    log_path: Path | None = None,
    timeout_s: float = 120.0,
    extra: Sequence[str] = (),
) -> Iterator[RunningLlamaServer]:
    """Start llama-server with ``settings`` on a free loopback port, wait for ``/health``, stop it
    after.

    Raises :class:`LlamaServerFailed` (with the load log read so far) when it exits or is not
    healthy within ``timeout_s``.
    """
    port = free_port()
    argv = llama_server_argv(
        str(model_path),
        settings,
        binary=str(binary or find_llama_server()),
        host="127.0.0.1",
        port=port,
        extra=tuple(extra),
    )
    load_log = LoadLog()
    proc = EngineProcess(argv, log_path=log_path, on_line=load_log.feed)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not proc.wait_healthy(f"{url}/health", timeout_s):
            proc.stop(grace_s=5.0)
            state = (
                f"exited with code {proc.returncode}"
                if proc.returncode is not None
                else "never became healthy"
            )
            raise LlamaServerFailed(
                f"llama-server {state} while loading {model_path}",
                "read the load log: an allocation failure means the split or context is too large",
                load_log,
                proc.tail(40),
            )
        yield RunningLlamaServer(url, proc, load_log, argv)
    finally:
        proc.stop(grace_s=10.0)


# --- what a llama-server binary offers: its flags, its version, the devices it sees -------------

_DEVICE_LINE = re.compile(
    r"^\s+(?P<name>\S+): (?P<description>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$"
)
_VERSION_LINE = re.compile(
    r"version: (?P<version>\S+)(?: \(build (?P<build>\d+), commit (?P<commit>\w+)\))?"
)


@dataclass(frozen=True)
class LlamaDevice:
    """One device llama.cpp offloads to (``--list-devices``), with its memory now."""

    name: str  # "CUDA0", "RPC0", "Vulkan0" …
    description: str
    total_bytes: int
    free_bytes: int

    @property
    def backend(self) -> str:
        """The buffer rules of :data:`~oomguard.tiering.settings.GPU_BACKENDS` it follows
        (ROCm shares ggml-cuda's allocator; other backends are priced like CUDA)."""
        return "rpc" if self.name.startswith("RPC") else "cuda"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return {
            "name": self.name,
            "description": self.description,
            "total_gib": round(self.total_bytes / GIB, 3),
            "free_gib": round(self.free_bytes / GIB, 3),
        }


def _run_binary(binary: Path, args: Sequence[str], timeout_s: float = 30.0) -> str:
    try:
        out = subprocess.run(
            [str(binary), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaServerNotFound(
            f"cannot run {binary}: {exc}", "check the llama-server binary"
        ) from None
    return out.stdout + out.stderr


@functools.lru_cache(maxsize=8)
def _flag_table(binary: str, mtime_ns: int) -> FlagTable:
    return parse_help(_run_binary(Path(binary), ["--help"]))


def llama_server_flags(binary: Path) -> FlagTable:
    """The flags of ``binary`` as its own ``--help`` lists them (read once per binary)."""
    return _flag_table(str(binary), binary.stat().st_mtime_ns)


def llama_server_version(binary: Path) -> str:
    """``b<build> (<commit>)`` as ``--version`` prints it, or ``unknown``."""
    m = _VERSION_LINE.search(_run_binary(binary, ["--version"]))
    if not m:
        return "unknown"
    return (
        f"{m.group('version')} (build {m.group('build')}, {m.group('commit')})"
        if m.group("build")
        else m.group("version")
    )


def list_devices(
    binary: Path, rpc: str | None = None, devices: str | None = None
) -> list[LlamaDevice]:
    """The devices llama-server offloads to (``--list-devices``, with the command's ``--rpc``
    servers), each with its total and free memory now; ``devices`` is ``--device`` (``none``:
    the CPU only)."""
    if devices is not None and devices.strip().lower() == "none":
        return []
    # --list-devices prints and exits as it is read: the RPC servers must come first
    args = (["--rpc", rpc] if rpc else []) + ["--list-devices"]
    found = []
    for line in _run_binary(binary, args).splitlines():
        m = _DEVICE_LINE.match(line)
        if m:
            found.append(
                LlamaDevice(
                    m.group("name"),
                    m.group("description"),
                    int(m.group("total")) * MIB,
                    int(m.group("free")) * MIB,
                )
            )
    if devices:
        wanted = {d.strip() for d in devices.split(",")}
        found = [d for d in found if d.name in wanted]
    return found
