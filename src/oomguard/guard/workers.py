"""``--workers N``: N gateway processes on one port, each a replica on the shared Redis state.

Each worker binds the port with ``SO_REUSEPORT`` (the kernel spreads new connections over
them); the parent only starts them, starts again one that dies, and stops them all on
SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

from oomguard.errors import BadInput
from oomguard.guard.config import GuardConfig

log = logging.getLogger("oomguard.guard")
# A worker that dies sooner than this after its start is not restarted in a loop.
_MIN_LIFE_S = 5.0


def _resolve_port(config: GuardConfig) -> GuardConfig:
    """A fixed port for all workers (port 0 picks one free port once)."""
    if config.port != 0:
        return config
    with socket.socket() as s:
        s.bind((config.host, 0))
        port = int(s.getsockname()[1])
    return config.model_copy(update={"port": port})


def run_workers(config: GuardConfig, serve: Callable[[GuardConfig], None]) -> None:
    """Run ``config.workers`` processes of ``serve(config)`` until SIGINT/SIGTERM."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise BadInput(
            "--workers needs SO_REUSEPORT, which this platform lacks",
            "run one guard per port behind a load balancer instead",
        )
    config = _resolve_port(config)
    ctx = multiprocessing.get_context("spawn")
    procs: list[tuple[BaseProcess, float]] = []
    stopping = False

    def start() -> tuple[BaseProcess, float]:
        p = ctx.Process(target=serve, args=(config,), daemon=False)
        p.start()
        return p, time.monotonic()

    def stop(_sig: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("starting %d guard workers on %s:%d", config.workers, config.host, config.port)
    procs = [start() for _ in range(config.workers)]
    try:
        while not stopping:
            time.sleep(0.2)
            for i, (p, started) in enumerate(procs):
                if p.is_alive() or stopping:
                    continue
                if time.monotonic() - started < _MIN_LIFE_S:
                    log.error(
                        "guard worker %d exited at once (code %s); not restarting", i, p.exitcode
                    )
                    stopping = True
                    break
                log.warning("guard worker %d exited (code %s); starting it again", i, p.exitcode)
                procs[i] = start()
    finally:
        for p, _ in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10
        for p, _ in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join()
