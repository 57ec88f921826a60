"""Where alert events go: JSON lines on stdout, a webhook, the terminal.

The webhook speaks Alertmanager's JSON in either direction:

- a URL ending in ``/api/v2/alerts`` is an Alertmanager: each event is POSTed as a list of
  *postable alerts* (``labels``, ``annotations``, ``startsAt``, ``endsAt`` once resolved,
  ``generatorURL``), and Alertmanager groups, silences and routes them;
- any other URL receives what Alertmanager itself sends to a webhook receiver (``version``
  "4", ``status``, ``receiver``, ``groupLabels``, ``commonLabels``, ``commonAnnotations``,
  ``externalURL``, ``alerts`` with ``fingerprint``), so a receiver written for Alertmanager
  (chat bridges, pagers) takes it unchanged.

Delivery never blocks the watch loop: events queue (bounded), a failed POST is retried with
backoff, and what could not be delivered is reported on stderr.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from typing import Any, TextIO

import aiohttp

from oomguard.watch.alerts import AlertEvent, iso_utc

RECEIVER = "oomguard-watch"
_RETRIES_S = (0.5, 2.0, 5.0)


def alert_labels(event: AlertEvent) -> dict[str, str]:
    """Alertmanager labels of an event: what identifies the alert instance."""
    return {
        "alertname": event.alert,
        "severity": event.severity,
        "server": event.server,
        "source": RECEIVER,
        **event.labels,
    }


def alert_annotations(event: AlertEvent) -> dict[str, str]:
    """Alertmanager annotations of an event: what a human reads."""
    return {
        "summary": _summary(event),
        "description": event.message,
        "value": f"{event.value:g}",
        "threshold": f"{event.threshold:g}",
    }


def _summary(event: AlertEvent) -> str:
    from oomguard.watch.rules import RULES_BY_NAME

    rule = RULES_BY_NAME.get(event.alert)
    return f"{rule.summary if rule else event.alert} on {event.server}"


def fingerprint(labels: dict[str, str]) -> str:
    """A stable 16-hex-digit identity of a label set (like Alertmanager's)."""
    text = "\xff".join(f"{k}\xfe{v}" for k, v in sorted(labels.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def postable_alert(event: AlertEvent, generator_url: str = "") -> dict[str, Any]:
    """One alert in the form Alertmanager's ``POST /api/v2/alerts`` takes."""
    alert: dict[str, Any] = {
        "labels": alert_labels(event),
        "annotations": alert_annotations(event),
        "startsAt": iso_utc(event.since_s),
        "generatorURL": generator_url,
    }
    if event.state == "resolved":
        alert["endsAt"] = iso_utc(event.at_s)
    return alert


def webhook_payload(event: AlertEvent, external_url: str = "") -> dict[str, Any]:
    """The body Alertmanager sends to a webhook receiver, for one event (``external_url``: the
    watcher's own address, when it serves one)."""
    labels = alert_labels(event)
    annotations = alert_annotations(event)
    group = {"alertname": event.alert}
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{event.alert}"}}',
        "truncatedAlerts": 0,
        "status": event.state,
        "receiver": RECEIVER,
        "groupLabels": group,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": external_url,
        "alerts": [
            {
                "status": event.state,
                "labels": labels,
                "annotations": annotations,
                "startsAt": iso_utc(event.since_s),
                "endsAt": iso_utc(event.at_s)
                if event.state == "resolved"
                else "0001-01-01T00:00:00Z",
                "generatorURL": external_url,
                "fingerprint": fingerprint(labels),
            }
        ],
    }


class JsonLinesSink:
    """Alert events as JSON lines (flushed at once: another program reads them live)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def emit(self, record: dict[str, Any]) -> None:
        """Write one JSON object as a line."""
        self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()


class WebhookSink:
    """POSTs events to a webhook or an Alertmanager, in the background, with retries."""

    def __init__(self, url: str, queue_size: int = 1000, own_url: str = "") -> None:
        self.url = url
        self.own_url = own_url
        self.to_alertmanager = url.rstrip("/").endswith("/api/v2/alerts")
        self.queue: asyncio.Queue[AlertEvent] = asyncio.Queue(queue_size)
        self.delivered = 0
        self.failed = 0
        self._task: asyncio.Task[None] | None = None

    def body(self, event: AlertEvent) -> Any:
        """The JSON body for ``event`` at this URL."""
        if self.to_alertmanager:
            return [postable_alert(event, self.own_url)]
        return webhook_payload(event, self.own_url)

    def start(self) -> None:
        """Start the delivery task (inside the running event loop)."""
        self._task = asyncio.create_task(self._deliver_forever())

    def submit(self, event: AlertEvent) -> None:
        """Queue an event; when the queue is full the event is counted as failed and said."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.failed += 1
            _warn(f"webhook {self.url}: queue full, {event.alert} {event.state} not sent")

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait (up to ``timeout_s``) until every queued event was delivered or given up."""
        try:
            await asyncio.wait_for(self.queue.join(), timeout_s)
        except asyncio.TimeoutError:
            _warn(f"webhook {self.url}: {self.queue.qsize()} event(s) not delivered")

    async def close(self) -> None:
        """Stop the delivery task."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _deliver_forever(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                event = await self.queue.get()
                try:
                    await self._deliver(session, event)
                finally:
                    self.queue.task_done()

    async def _deliver(self, session: aiohttp.ClientSession, event: AlertEvent) -> None:
        error = ""
        for delay_s in (0.0, *_RETRIES_S):
            await asyncio.sleep(delay_s)
            try:
                async with session.post(
                    self.url, json=self.body(event), timeout=aiohttp.ClientTimeout(total=10)
                ) as resp:
                    if resp.status < 300:
                        self.delivered += 1
                        return
                    error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    if 400 <= resp.status < 500 and resp.status != 429:
                        break  # the receiver refuses this body: retrying will not help
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
        self.failed += 1
        _warn(f"webhook {self.url}: {event.alert} {event.state} not delivered ({error})")


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)
