"""Launch vLLM with the plan, check the prediction against its log, heal a startup OOM, and
supervise (``oomguard serve``).

The Python API returns the same events the CLI prints::

    from oomguard.serve import serve
    result = serve("vllm serve ./my-model --max-model-len 32768", stop=stop_event)
    result.exit_code, [e.to_dict() for e in result.events]

``serve`` blocks while the server runs; set ``stop`` (a :class:`threading.Event`) from another
thread to stop it cleanly, and pass ``on_event`` to follow the launch as it happens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.serve.events import Event, EventHandler
from oomguard.serve.heal import HealWorkload

__all__ = ["Event", "ServeResult", "HealWorkload", "serve"]


@dataclass(frozen=True)
class ServeResult:
    """How a serve ended, and everything it reported on the way."""

    exit_code: int
    events: tuple[Event, ...]

    def of_kind(self, kind: str) -> list[Event]:
        """The events of one kind, in order."""
        return [e for e in self.events if e.kind == kind]


def serve(
    command: str | Sequence[str] | None = None,
    *,
    model: str | None = None,
    p99_tokens: int | None = None,
    concurrency: int | None = None,
    on_event: EventHandler | None = None,
    on_line: Any = None,
    stop: threading.Event | None = None,
    base_dir: str | Path | None = None,
    **options: Any,
) -> ServeResult:
    """Serve ``command`` (a pasted ``vllm serve …`` or ``llama-server …`` line) or plan for
    ``model`` (a ``.gguf`` file is served by llama.cpp) and serve that.

    ``options`` are :class:`~oomguard.serve.session.ServeOptions` fields (``max_attempts``,
    ``probe``, ``guard_port``, ``plan_settings``, ``log_dir``, ``dry_run`` …). Bad input raises
    :class:`~oomguard.errors.BadInput`; every other outcome is in the result's exit code and
    events.
    """
    import shlex

    from oomguard.serve.command import EngineCommand
    from oomguard.serve.llama_session import LlamaServeSession, PastedLlamaCommand, is_llama_server
    from oomguard.serve.session import ServeOptions, ServeSession

    parsed: Any = None
    where = Path(base_dir or Path.cwd())
    if command is not None:
        tokens = [command] if isinstance(command, str) else list(command)
        words = shlex.split(tokens[0]) if len(tokens) == 1 else tokens
        first = next((w for w in words if "=" not in w or w.startswith("-")), "")
        if is_llama_server(first):
            parsed = PastedLlamaCommand.from_tokens(words, base_dir=where)
            options.setdefault("engine", "llama.cpp")
        else:
            parsed = EngineCommand.from_tokens(tokens, base_dir=where)
    if model is not None and str(model).endswith(".gguf"):
        options.setdefault("engine", "llama.cpp")
    opts = ServeOptions(
        command=parsed,
        model=model,
        workload=HealWorkload(p99_tokens=p99_tokens, concurrency=concurrency),
        **options,
    )
    handlers = [on_event] if on_event is not None else []
    session: Any
    if opts.engine == "llama.cpp":
        session = LlamaServeSession(opts, handlers=handlers, line_sink=on_line, stop_event=stop)
    else:
        session = ServeSession(opts, handlers=handlers, line_sink=on_line, stop_event=stop)
    code = session.run()
    return ServeResult(exit_code=code, events=tuple(session.events.events))
