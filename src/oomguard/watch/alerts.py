"""Alert states: pending, firing, resolved, with a minimum duration and hysteresis.

An :class:`AlertTracker` follows every (rule, server, labels) the evaluator reports on. A
condition that holds starts a pending alert; after the rule's ``for_s`` it fires (one
``firing`` event). A firing alert stays firing while the value is past the rule's clearing
level, and resolves (one ``resolved`` event) when it is not. A condition that stops holding
while pending is forgotten without an event. Pure: the caller passes the time.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from oomguard.watch.rules import AlertRule


def iso_utc(epoch_s: float) -> str:
    """``epoch_s`` as an ISO-8601 UTC timestamp (what Alertmanager's API reads)."""
    return (
        dt.datetime.fromtimestamp(epoch_s, tz=dt.timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


@dataclass(frozen=True)
class Observation:
    """One rule's reading for one server (and GPU, where it is per GPU) at one moment.

    ``breached`` is whether the firing condition holds now; ``still_breached`` whether a
    firing alert should stay firing (the clearing level). Rules whose condition is more than
    a threshold (a leak, a server down) set them themselves.
    """

    rule: AlertRule
    server: str
    value: float
    breached: bool
    still_breached: bool
    message: str
    labels: dict[str, str] = field(default_factory=dict)
    severity: str | None = None  # overrides the rule's (a leak close to exhaustion: critical)

    @property
    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        """What identifies one alert instance."""
        return (self.rule.name, self.server, tuple(sorted(self.labels.items())))


def observe(rule: AlertRule, server: str, value: float, message: str, **labels: str) -> Observation:
    """An observation judged by the rule's own threshold and clearing level."""
    return Observation(
        rule, server, value, rule.breached(value), rule.still_breached(value), message, labels
    )


@dataclass(frozen=True)
class AlertEvent:
    """An alert that started firing or resolved."""

    alert: str
    severity: str
    state: str  # "firing" | "resolved"
    value: float
    threshold: float
    server: str
    since_s: float  # when the condition began (firing) / when it began firing (resolved)
    at_s: float  # when this event happened
    message: str
    labels: dict[str, str] = field(default_factory=dict)
    unit: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON-lines form: ``{"event": "alert", "alert", "severity", "state", …}``."""
        return {
            "event": "alert",
            "alert": self.alert,
            "severity": self.severity,
            "state": self.state,
            "value": _round(self.value),
            "threshold": _round(self.threshold),
            "unit": self.unit,
            "server": self.server,
            "since": iso_utc(self.since_s),
            "at": iso_utc(self.at_s),
            "message": self.message,
            "labels": dict(self.labels),
        }


def _round(value: float) -> float:
    return round(value, 4) if abs(value) < 1e3 else round(value)


@dataclass
class _Instance:
    observation: Observation
    pending_since_s: float
    firing_since_s: float | None = None


class AlertTracker:
    """Every alert instance's state; :meth:`update` turns observations into events.

    ``min_duration_s`` replaces every rule's ``for_s`` when given (``--min-duration``).
    """

    def __init__(self, min_duration_s: float | None = None) -> None:
        self.min_duration_s = min_duration_s
        self._instances: dict[tuple[str, str, tuple[tuple[str, str], ...]], _Instance] = {}

    def _for_s(self, rule: AlertRule) -> float:
        return rule.for_s if self.min_duration_s is None else self.min_duration_s

    def update(
        self, now_s: float, observations: list[Observation], servers: set[str] | None = None
    ) -> list[AlertEvent]:
        """Apply one round of observations (made at ``now_s``) and return the events.

        An instance not observed this round keeps its state, unless its server is in
        ``servers`` (the servers this round covered): then its condition is taken as gone
        (a GPU that left, a series that ended), and a firing alert resolves.
        """
        events: list[AlertEvent] = []
        seen = set()
        for obs in observations:
            seen.add(obs.key)
            events.extend(self._step(now_s, obs))
        if servers is not None:
            for key, inst in list(self._instances.items()):
                if key not in seen and inst.observation.server in servers:
                    gone = Observation(
                        inst.observation.rule,
                        inst.observation.server,
                        inst.observation.value,
                        False,
                        False,
                        inst.observation.message,
                        inst.observation.labels,
                    )
                    events.extend(self._step(now_s, gone))
        return events

    def _step(self, now_s: float, obs: Observation) -> list[AlertEvent]:
        inst = self._instances.get(obs.key)
        if inst is None:
            if not obs.breached:
                return []
            inst = self._instances[obs.key] = _Instance(obs, now_s)
        if inst.firing_since_s is None:
            if not obs.breached:
                del self._instances[obs.key]
                return []
            inst.observation = obs
            if now_s - inst.pending_since_s >= self._for_s(obs.rule):
                inst.firing_since_s = now_s
                return [self._event(obs, "firing", inst.pending_since_s, now_s)]
            return []
        if obs.still_breached:
            inst.observation = obs
            return []
        del self._instances[obs.key]
        return [self._event(obs, "resolved", inst.firing_since_s, now_s)]

    @staticmethod
    def _event(obs: Observation, state: str, since_s: float, now_s: float) -> AlertEvent:
        return AlertEvent(
            alert=obs.rule.name,
            severity=obs.severity or obs.rule.severity,
            state=state,
            value=obs.value,
            threshold=obs.rule.threshold,
            server=obs.server,
            since_s=since_s,
            at_s=now_s,
            message=obs.message,
            labels=dict(obs.labels),
            unit=obs.rule.unit,
        )

    def firing(self) -> list[Observation]:
        """The observations behind every alert firing now."""
        return [i.observation for i in self._instances.values() if i.firing_since_s is not None]

    def firing_since(self) -> dict[tuple[str, str, tuple[tuple[str, str], ...]], float]:
        """When each firing alert began firing."""
        return {
            k: i.firing_since_s for k, i in self._instances.items() if i.firing_since_s is not None
        }
