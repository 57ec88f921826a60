"""The engine-specific parts of serve behind one small interface.

A launch needs, from the engine it runs: the process to start for a command, where its health
answers, a reader for its log (phases, numbers, failures as they appear), the memory model's
prediction, and the next configuration after a memory failure. :class:`EngineKind` names
exactly those; :class:`VllmEngine` implements them for vLLM. Another engine (llama.cpp's
``llama-server``) plugs in by implementing the same methods over its own command type.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from oomguard.engine import VllmInstall, find_vllm
from oomguard.logs import ParsedLog, Phase
from oomguard.logs.follow import LogFollower
from oomguard.serve.command import EngineCommand
from oomguard.serve.heal import HealContext, HealDecision, decide

# environment every engine gets on top of the user's: output line by line as it is written
# (a failure must be read when it happens, not when a buffer fills)
# unbuffered output; and a process killed by a signal (SIGILL, SIGSEGV) writes "Fatal Python
# error: Illegal instruction" and its stack to the log, so the death is named there
_UNBUFFERED = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}

PHASE_LABELS: dict[Phase, str] = {
    Phase.STARTUP: "starting",
    Phase.WEIGHT_LOADING: "loading weights",
    Phase.PROFILING: "profiling",
    Phase.KV_ALLOCATION: "allocating the KV cache",
    Phase.SAMPLER_WARMUP: "sampler warm-up",
    Phase.CUDA_GRAPH_CAPTURE: "capturing CUDA graphs",
    Phase.SERVING: "engine up, starting the API server",
}


class LogReader(Protocol):
    """Reads an engine's log line by line (see :class:`~oomguard.logs.follow.LogFollower`)."""

    def feed(self, chunk: str) -> object:
        """Take one line as it is written; return what it showed."""
        ...

    def parsed(self) -> ParsedLog:
        """Everything read so far."""
        ...


class EngineKind(Protocol):
    """What serve needs from an engine."""

    name: str
    version: str
    cpu_build: bool  # sizes its pool in host RAM

    def argv(self, command: EngineCommand) -> list[str]:
        """The process to start for ``command``."""
        ...

    def environment(self, command: EngineCommand) -> dict[str, str]:
        """The environment to start it with."""
        ...

    def health_url(self, command: EngineCommand) -> str:
        """A URL that answers 200 once the server serves."""
        ...

    def new_reader(self) -> LogFollower:
        """A fresh reader of this engine's log."""
        ...

    def heal(self, ctx: HealContext) -> HealDecision:
        """The next configuration after the memory failure in ``ctx``."""
        ...


class VllmEngine:
    """vLLM, launched through its module entry point with the interpreter that has it."""

    name = "vllm"

    def __init__(self, install: VllmInstall) -> None:
        self.install = install
        self.version = install.version
        self.cpu_build = install.cpu_build

    @classmethod
    def find(cls, python: str | Path | None = None) -> VllmEngine:
        """The vLLM to launch (``python`` first; raises ``VllmNotFound``, exit 5)."""
        return cls(find_vllm(python))

    def argv(self, command: EngineCommand) -> list[str]:
        """``python -m vllm.entrypoints.openai.api_server --model MODEL …`` (same flags as
        ``vllm serve MODEL …``)."""
        return self.install.server_argv(command.model, command.args)

    def environment(self, command: EngineCommand) -> dict[str, str]:
        """This process's environment, the command's own assignments, unbuffered output and
        Python's fault handler."""
        env = dict(os.environ)
        env.update(command.env)
        for name, value in _UNBUFFERED.items():
            env.setdefault(name, value)
        return env

    def health_url(self, command: EngineCommand) -> str:
        """vLLM's ``/health`` (200 once the engine and the API server are up)."""
        return command.base_url + "/health"

    def new_reader(self) -> LogFollower:
        """A fresh follower over the shared log catalogue."""
        return LogFollower()

    def heal(self, ctx: HealContext) -> HealDecision:
        """The first of the doctor's fixes serve's checks accept (:mod:`oomguard.serve.heal`)."""
        return decide(ctx)
