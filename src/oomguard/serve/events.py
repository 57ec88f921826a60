"""What a launch reports, as events: the same values the terminal shows and ``--json`` prints.

Every event has a kind, a wall-clock timestamp and the seconds since serve started. Kinds, in
the order a launch produces them:

``plan``        the command about to run and the memory model's prediction for it
``launch``      one launch of the engine: its number, command, pid, log file
``phase``       the startup phase the log reached (loading weights … ready)
``observed``    a number the log stated, with its line
``compare``     a predicted term beside the observed one, with the difference
``failure``     a memory failure (or a crash, or a non-memory failure) and its line, with the
                time from that line to the kill
``heal``        the next configuration: the cause, the changed flags and why, what was refused
``ready``       the server answers; its observed figures
``calibration`` the observed terms stored for the next ``plan``
``probe``       a probe's result
``guard``       ``oomguard guard`` started in front of the engine
``restart``     a crashed engine is started again
``alternatives`` what ``plan`` proposes when no configuration could be made to start
``note``        anything else worth knowing
``exit``        the end: exit code and reason
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

KINDS = (
    "plan",
    "launch",
    "phase",
    "observed",
    "compare",
    "failure",
    "heal",
    "ready",
    "calibration",
    "probe",
    "guard",
    "restart",
    "alternatives",
    "note",
    "exit",
)


@dataclass(frozen=True)
class Event:
    """One thing that happened, with when."""

    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """``{"event": kind, "ts": ISO 8601 UTC, "elapsed_s": …, **data}``."""
        stamp = datetime.fromtimestamp(self.ts, tz=timezone.utc).isoformat(timespec="milliseconds")
        return {"event": self.kind, "ts": stamp, "elapsed_s": round(self.elapsed_s, 3), **self.data}

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(self.to_dict(), default=str)


EventHandler = Callable[[Event], None]


class EventLog:
    """Collects events in order and hands each to the handlers as it happens."""

    def __init__(self, handlers: list[EventHandler] | None = None) -> None:
        self.events: list[Event] = []
        self._handlers = list(handlers or [])
        self._started = time.monotonic()

    def emit(self, event_kind: str, /, **data: Any) -> Event:
        """Record an event of ``event_kind`` and pass it on."""
        if event_kind not in KINDS:
            raise ValueError(f"unknown event kind {event_kind!r}")
        event = Event(event_kind, data, elapsed_s=time.monotonic() - self._started)
        self.events.append(event)
        for handler in self._handlers:
            handler(event)
        return event

    def of_kind(self, kind: str) -> list[Event]:
        """The events of one kind, in order."""
        return [e for e in self.events if e.kind == kind]
