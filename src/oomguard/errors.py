"""Errors a user can hit. Each renders as one line: what is wrong, then what to do."""

from __future__ import annotations


class OomguardError(Exception):
    """Base class: ``message`` says what is wrong, ``hint`` says how to fix it."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message} — {self.hint}" if self.hint else self.message


class BadInput(OomguardError):
    """The user gave something we cannot use (flag, value, file)."""


class UnknownModel(BadInput):
    """No facts for this model: not in the catalogue, not a local path, hub unreachable."""


class UnsupportedArchitecture(BadInput):
    """The config describes an architecture whose memory we cannot account for (fail closed)."""


class MalformedConfig(BadInput):
    """A config.json / safetensors header / GGUF file that cannot be read."""


class UnknownGPU(BadInput):
    """A GPU name that is not in the catalogue."""
