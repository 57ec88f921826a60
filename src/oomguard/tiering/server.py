"""Find llama-server, run it on a model through :class:`~oomguard.engine.EngineProcess`, read its load.

The binary is, in order: ``$OOMGUARD_LLAMA_SERVER``, the build that
``scripts/setup-llama-server.sh`` caches under ``~/.cache/oomguard/llama.cpp/<version>/bin``
(``$OOMGUARD_CACHE`` moves it), or ``llama-server`` on ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from oomguard.engine import EngineProcess
from oomguard.errors import BadInput
from oomguard.tiering.command import llama_server_argv
from oomguard.tiering.loadlog import LoadLog
from oomguard.tiering.settings import LlamaCppSettings


class LlamaServerNotFound(BadInput):
    """No llama-server binary was found."""


class LlamaServerFailed(BadInput):
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
            raise LlamaServerNotFound(f"$OOMGUARD_LLAMA_SERVER={env} is not a file",
                                      "point it at a llama-server binary")  # fmt: skip
        return path
    if env and name != "llama-server" and (Path(env).parent / name).is_file():
        return Path(env).parent / name
    cached = _cached_binaries(name)
    if cached:
        return cached[0]
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise LlamaServerNotFound(f"{name} not found",
                              "build it with scripts/setup-llama-server.sh or set $OOMGUARD_LLAMA_SERVER")  # fmt: skip


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
        raise BadInput("llama-server's /props lacks total_slots or default_generation_settings.n_ctx",
                       "check that the URL is a llama-server")  # fmt: skip
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
    """Start llama-server with ``settings`` on a free loopback port, wait for ``/health``, stop it after.

    Raises :class:`LlamaServerFailed` (with the load log read so far) when it exits or is not
    healthy within ``timeout_s``.
    """
    port = free_port()
    argv = llama_server_argv(str(model_path), settings, binary=str(binary or find_llama_server()),
                             host="127.0.0.1", port=port, extra=tuple(extra))  # fmt: skip
    load_log = LoadLog()
    proc = EngineProcess(argv, log_path=log_path, on_line=load_log.feed)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not proc.wait_healthy(f"{url}/health", timeout_s):
            proc.stop(grace_s=5.0)
            state = f"exited with code {proc.returncode}" if proc.returncode is not None else "never became healthy"
            raise LlamaServerFailed(
                f"llama-server {state} while loading {model_path}",
                "read the load log: an allocation failure means the split or context is too large",
                load_log, proc.tail(40),
            )  # fmt: skip
        yield RunningLlamaServer(url, proc, load_log, argv)
    finally:
        proc.stop(grace_s=10.0)
