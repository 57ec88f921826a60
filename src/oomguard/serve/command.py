"""The engine command serve launches: read from what the user pasted, changed flag by flag.

The user's own command is kept as given (its flags, their order, a ``--config FILE``); a heal
replaces one flag's value, or appends the flag (vLLM reads the command line after the config
file, so an appended flag wins over the file). What vLLM would run is read back through
:func:`oomguard.vllm_args.parse_command`, the same reader ``plan`` and ``doctor`` use, so
"the same configuration" means the same model, settings and flags, however they were spelt.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from oomguard.errors import BadInput
from oomguard.vllm_args import (
    BOOL_FLAGS,
    LIST_FLAGS,
    Launcher,
    ParsedCommand,
    canonical_flag,
    parse_command,
    split_launcher,
)

DEFAULT_PORT = 8000
# flags that say where the server listens or how it logs, not what it serves: two commands
# that differ only in these are the same configuration
_NOT_CONFIGURATION = frozenset({"host", "port", "uvicorn-log-level", "disable-log-stats"})


@dataclass(frozen=True)
class EngineCommand:
    """A vLLM server command: the model, its flags (as the user wrote them), the interpreter
    a pasted ``python -m`` line named, and environment assignments that led the line."""

    model: str
    args: tuple[str, ...] = ()
    python: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    base_dir: Path | None = None  # resolves a relative --config

    # --- reading ----------------------------------------------------------------------------
    @classmethod
    def from_tokens(cls, tokens: Sequence[str], *, base_dir: Path | None = None) -> EngineCommand:
        """Read a pasted ``vllm serve MODEL …`` or ``python -m vllm.entrypoints.openai.api_server
        --model MODEL …`` command (leading ``VAR=value`` assignments are kept as environment).

        Raises :class:`BadInput` for anything else (a container command, another program) and
        for a flag vLLM does not have.
        """
        words = [t for t in tokens if t not in ("\\", "\\\n")]
        if len(words) == 1 and " " in words[0]:
            words = shlex.split(words[0].replace("\\\n", " "))
        launcher = _server_launcher(words)
        env, python, rest = launcher.env, launcher.python, launcher.args
        command = cls(model="", args=tuple(rest), python=python, env=env, base_dir=base_dir)
        parsed = command._parse_with_model_in_args()
        command = replace(command, model=parsed.model, args=_without_model(rest, parsed.model))
        command.check()
        return command

    def _parse_with_model_in_args(self) -> ParsedCommand:
        return parse_command(["vllm", "serve", *self.args], base_dir=self.base_dir)

    def parsed(self) -> ParsedCommand:
        """The command as vLLM reads it (config file merged; the command line wins)."""
        return parse_command(["vllm", "serve", self.model, *self.args], base_dir=self.base_dir)

    def check(self) -> None:
        """Raise :class:`BadInput` for flags vLLM does not have (it would refuse to start)."""
        parsed = self.parsed()
        if parsed.unknown:
            names = ", ".join(
                n if n.startswith("-") or "/" in n else f"--{n}" for n in parsed.unknown
            )
            raise BadInput(
                f"not a vLLM flag: {names}",
                "check the spelling (vLLM's flags are listed by `vllm serve --help`)",
            )

    # --- where it listens -------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port the server will listen on (vLLM's default 8000)."""
        value = self.parsed().other_flags.get("port")
        try:
            return int(str(value)) if value not in (None, True, False) else DEFAULT_PORT
        except ValueError:
            raise BadInput(f"--port {value} is not a port number", "pass --port N") from None

    @property
    def host(self) -> str:
        """The address to reach the server at (a wildcard bind is reached on loopback)."""
        value = self.parsed().other_flags.get("host")
        if value in (None, True, False, "", "0.0.0.0", "::"):
            return "127.0.0.1"
        return str(value)

    @property
    def bind_host(self) -> str:
        """The address the server binds (vLLM's default: every interface)."""
        value = self.parsed().other_flags.get("host")
        return "0.0.0.0" if value in (None, True, False, "") else str(value)

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the OpenAI-compatible server."""
        host = self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    # --- changing ---------------------------------------------------------------------------
    def with_flag(self, flag: str, value: str | None) -> EngineCommand:
        """A copy with ``flag`` set to ``value`` (every spelling of it removed first, then
        ``--flag value`` appended); ``value`` None sets a boolean flag."""
        name = canonical_flag(flag.lstrip("-"))
        kept: list[str] = []
        i = 0
        args = list(self.args)
        while i < len(args):
            token = args[i]
            i += 1
            if not token.startswith("-"):
                kept.append(token)
                continue
            raw, has_inline, _ = token.lstrip("-").partition("=")
            canonical = canonical_flag(raw)
            negated = canonical.startswith("no-") and canonical_flag(canonical[3:]) == name
            if canonical != name and not negated:
                kept.append(token)
                continue
            if has_inline or name in BOOL_FLAGS or negated:
                continue
            if name in LIST_FLAGS:
                while i < len(args) and not args[i].startswith("--"):
                    i += 1
            elif i < len(args) and not args[i].startswith("--"):
                i += 1
        kept += [f"--{name}"] if value is None else [f"--{name}", str(value)]
        return replace(self, args=tuple(kept))

    def with_flags(self, changes: Mapping[str, str | None]) -> EngineCommand:
        """A copy with every ``flag → value`` of ``changes`` applied in order."""
        command = self
        for flag, value in changes.items():
            command = command.with_flag(flag, value)
        return command

    # --- identity and display ---------------------------------------------------------------
    def key(self) -> str:
        """What makes two commands the same configuration (model, settings and flags as vLLM
        reads them, and the environment the command sets; where it listens does not count)."""
        parsed = self.parsed()
        other = {k: v for k, v in parsed.other_flags.items() if k not in _NOT_CONFIGURATION}
        return json.dumps(
            {
                "model": parsed.model,
                "settings": dict(parsed.settings_kwargs),
                "flags": other,
                "env": dict(self.env),
            },
            sort_keys=True,
            default=str,
        )

    def display(self) -> str:
        """The command as the user would type it: ``vllm serve MODEL --flags…``."""
        env = [f"{k}={v}" for k, v in self.env.items()]
        return shlex.join([*env, "vllm", "serve", self.model, *self.args])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the command line, the model and the flags."""
        return {"command": self.display(), "model": self.model, "args": list(self.args)}


def _server_launcher(words: list[str]) -> Launcher:
    """The launcher of a command serve can start itself: ``vllm serve`` or ``python -m``."""
    if not words:
        raise BadInput("no command after --", "write: oomguard serve -- vllm serve MODEL --flags…")
    launcher = split_launcher(words)
    if launcher.form in ("vllm", "python"):
        return launcher
    if launcher.form == "container":
        raise BadInput(
            f"serve launches vLLM itself and cannot supervise a {launcher.tool} container",
            "paste the 'vllm serve …' command the container runs (or run oomguard serve inside it)",
        )
    raise BadInput(
        f"{words[0]!r} is not a vLLM server command",
        "write: oomguard serve -- vllm serve MODEL --flags…",
    )


def _without_model(args: Sequence[str], model: str) -> tuple[str, ...]:
    """``args`` without the model: the ``--model X`` flag, or the first bare word equal to it
    that is not a flag's value."""
    from oomguard.vllm_args import VALUE_FLAGS

    out: list[str] = []
    removed = False
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token.startswith("-"):
            raw, has_inline, _ = token.lstrip("-").partition("=")
            name = canonical_flag(raw)
            if name == "model":
                if not has_inline and i < len(args):
                    i += 1
                continue
            out.append(token)
            if not has_inline and name in VALUE_FLAGS and i < len(args):
                out.append(args[i])
                i += 1
            continue
        if not removed and token == model:
            removed = True
            continue
        out.append(token)
    return tuple(out)
