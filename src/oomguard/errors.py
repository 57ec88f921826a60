"""Errors a user can hit. Each renders as one line: what is wrong, then what to do.

The class says whose problem it is, and so the exit code (docs/exit-codes.md):

- :class:`BadInput` (2): something the user gave (a flag, a value, a file, a model name).
- :class:`EnvironmentProblem` (5): something the machine lacks or cannot reach (vLLM, a
  driver, a server, an optional extra).
- :class:`EngineFailed` (6): the engine was run and failed (would not start, died, left
  processes behind).

Codes 0 and 1 are each face's own answer (fits / does not fit, healthy / firing); the doctor
uses 3 and 4 for its own outcomes, so these errors stay clear of them.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 5
EXIT_ENGINE_FAILED = 6


class OomguardError(Exception):
    """Base class: ``message`` says what is wrong, ``hint`` says how to fix it."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message} — {self.hint}" if self.hint else self.message


class BadInput(OomguardError):
    """The user gave something we cannot use (flag, value, file)."""


class EnvironmentProblem(OomguardError):
    """The input is fine but the machine lacks something or cannot reach it."""

    exit_code = EXIT_ENVIRONMENT


class MissingExtra(EnvironmentProblem):
    """A face's optional dependencies are not installed."""

    def __init__(self, face: str, extra: str, module: str) -> None:
        super().__init__(
            f"oomguard {face} needs the {extra} extra ({module} is not installed)",
            f"pip install 'oomguard[{extra}]'",
        )
        self.face = face
        self.extra = extra
        self.module = module


class EngineFailed(OomguardError):
    """The engine (vLLM, llama-server) was run and failed: not started, died, left behind."""

    exit_code = EXIT_ENGINE_FAILED


class UnknownModel(BadInput):
    """No facts for this model: not in the catalogue, not a local path, hub unreachable."""


class UnsupportedArchitecture(BadInput):
    """The config describes an architecture whose memory we cannot account for (fail closed)."""


class MalformedConfig(BadInput):
    """A config.json / safetensors header / GGUF file that cannot be read."""


class UnknownGPU(BadInput):
    """A GPU name that is not in the catalogue."""
