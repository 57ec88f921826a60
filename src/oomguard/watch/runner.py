"""The watch loop: sample every target each interval, evaluate, emit events, serve /metrics.

A target that cannot be reached stays watched (and raises ``OomguardServerDown``); one that
answers but is not vLLM is reported once, as one line, and dropped; when no target is left,
the watch ends with exit code 2 (bad input).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from rich.console import Console

from oomguard.engine.memory import DeviceMemory
from oomguard.errors import BadInput
from oomguard.watch.alerts import AlertEvent, AlertTracker
from oomguard.watch.evaluate import Evaluator
from oomguard.watch.prefix import PrefixCacheRecorder
from oomguard.watch.sampling import GpuReader, Target, TargetSample, sample_target
from oomguard.watch.sinks import JsonLinesSink, WebhookSink

EXIT_HEALTHY, EXIT_FIRING, EXIT_BAD_INPUT = 0, 1, 2


@dataclass
class Outputs:
    """Where results go: JSON lines, webhooks, the terminal (live view or plain lines)."""

    json: JsonLinesSink | None = None
    webhooks: list[WebhookSink] = field(default_factory=list)
    console: Console | None = None  # human output (stdout, or stderr under --json)
    live: bool = False  # a live view on a terminal


class Watch:
    """One watch run over ``targets``."""

    def __init__(
        self,
        targets: list[Target],
        evaluator: Evaluator,
        tracker: AlertTracker,
        outputs: Outputs,
        interval_s: float = 1.0,
        port: int | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        self.targets = targets
        self.evaluator = evaluator
        self.tracker = tracker
        self.outputs = outputs
        self.interval_s = interval_s
        self.port = port
        self.host = host
        self.gpu = GpuReader()
        self.devices: list[DeviceMemory] | None = None
        self.scrape_errors: dict[str, int] = {}
        self.event_counts: dict[str, int] = {}
        self.bad_targets: list[str] = []
        self.rounds = 0
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.recorder: PrefixCacheRecorder | None = None  # stores the prefix-cache hit rate

    # -- one round ------------------------------------------------------------------------
    async def round(self, session: aiohttp.ClientSession) -> list[AlertEvent]:
        """Sample every target once, evaluate, and return the alert events of this round."""
        self.devices = (
            await asyncio.to_thread(self.gpu.read) if self.gpu.available is not False else None
        )
        kept = await self._sample_targets(session)
        for s in kept:
            if not s.up:
                self.scrape_errors[s.name] = self.scrape_errors.get(s.name, 0) + 1
        now_s = time.time()
        if self.recorder is not None:
            self.recorder.observe(kept, now_s)
            if self.recorder.due():
                await self.record_prefix_cache(session)
        observations = self.evaluator.round(kept, self.devices)
        covered = {s.name for s in kept if s.up}
        if self.devices is not None:
            covered.add(self.evaluator.host)
        events = self.tracker.update(now_s, observations, covered)
        self.rounds += 1
        for e in events:
            self.event_counts[e.state] = self.event_counts.get(e.state, 0) + 1
            self._emit(e)
        return events

    async def _sample_targets(self, session: aiohttp.ClientSession) -> list[TargetSample]:
        """Every target sampled once (those that turned out not to be vLLM dropped)."""
        local = [t for t in self.targets if t.local]
        timeout_s = max(1.0, min(5.0, self.interval_s * 2))
        samples = await asyncio.gather(
            *(
                sample_target(t, session, self.devices, len(local) == 1, timeout_s)
                for t in self.targets
            )
        )
        return [s for s in samples if not self._refused(s)]

    async def _close_prefix_windows(self, session: aiohttp.ClientSession) -> None:
        """At the stop: read the counters once more, so each window ends at the stop and not
        at the last round, then store the windows."""
        if self.recorder is None:
            return
        self.recorder.observe(await self._sample_targets(session), time.time())
        await self.record_prefix_cache(session)

    async def record_prefix_cache(self, session: aiohttp.ClientSession) -> None:
        """Store each server's prefix-cache window in the calibration store and say so."""
        if self.recorder is None:
            return
        local = {t.name for t in self.targets if t.local}
        for row in await self.recorder.record(session, self.devices, local):
            if self.outputs.json is not None:
                self.outputs.json.emit({"event": "prefix_cache", **row})
            elif self.outputs.console is not None and not self.outputs.live:
                what = (
                    f"stored under {row['key']}" if row["stored"] else f"not stored: {row['why']}"
                )
                self.outputs.console.print(
                    f"prefix cache {row['server']}: {what}", style="dim", highlight=False
                )

    def _refused(self, s: TargetSample) -> bool:
        """Drop a target that answered but is not vLLM (said once); True when dropped."""
        target = next(t for t in self.targets if t.name == s.name)
        if s.snapshot is not None:
            target.seen_vllm = True
        if not s.not_vllm or target.seen_vllm:
            return False
        self.targets.remove(target)
        self.evaluator.states.pop(s.name, None)
        line = f"{s.name} is not a vLLM server: {s.error}"
        self.bad_targets.append(line)
        hint = "pass the vLLM server's base URL (the one that serves /v1 and /metrics)"
        self._error(f"{line} — {hint}")
        return True

    # -- outputs --------------------------------------------------------------------------
    def _emit(self, event: AlertEvent) -> None:
        if self.outputs.json is not None:
            self.outputs.json.emit(event.to_dict())
        for hook in self.outputs.webhooks:
            hook.submit(event)
        console = self.outputs.console
        if console is not None and self.outputs.json is None:
            colour = "red" if event.severity == "critical" else "yellow"
            if event.state == "resolved":
                colour = "green"
            console.print(
                f"[{colour}]{event.state.upper():8}[/] {event.alert} "
                f"[dim]{event.server}[/] {event.message}",
                highlight=False,
                soft_wrap=True,
            )

    def _error(self, text: str) -> None:
        print(f"error: {text}", file=sys.stderr, flush=True)
        if self.outputs.json is not None:
            self.outputs.json.emit({"event": "error", "message": text})

    def status(self) -> dict[str, Any]:
        """Every target's latest figures and the alerts firing (``--once --json``, ``/status``)."""
        servers = []
        for name, st in self.evaluator.states.items():
            s = st.sample
            snap = s.snapshot if s else None
            servers.append(
                {
                    "server": name,
                    "up": bool(s and s.up),
                    "error": s.error if s else "",
                    "kv_cache_usage": snap.kv_cache_usage if snap else None,
                    "kv_cache_tokens": snap.kv_cache_tokens if snap else None,
                    "requests_running": snap.requests_running if snap else None,
                    "requests_waiting": snap.requests_waiting if snap else None,
                    "requests_waiting_for_capacity": snap.waiting_for_capacity if snap else None,
                    "preemptions_total": snap.preemptions_total if snap else None,
                    "recent_preemptions": st.recent_preemptions,
                    "host_rss_bytes": s.host_rss_bytes if s else None,
                    "gpu_source": s.gpu_source if s else "none",
                    "gpu_note": s.gpu_note if s else "",
                    "gpus": [g.__dict__ for g in s.gpus] if s else [],
                    "plan": st.plan.to_dict() if st.plan else None,
                }
            )
        firing = [
            {
                "alert": o.rule.name,
                "severity": o.severity or o.rule.severity,
                "server": o.server,
                "value": o.value,
                "message": o.message,
                "labels": o.labels,
            }
            for o in self.tracker.firing()
        ]
        return {
            "event": "status",
            "healthy": not firing,
            "servers": servers,
            "firing": firing,
            "gpus": None if self.devices is None else [d.__dict__ for d in self.devices],
            "not_vllm": list(self.bad_targets),
        }

    # -- serving /metrics -------------------------------------------------------------------
    async def _serve(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from oomguard.watch.exporter import make_registry

        registry = make_registry(self)

        async def metrics(_: web.Request) -> web.Response:
            body = await asyncio.to_thread(generate_latest, registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status())

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        app = web.Application()
        app.add_routes(
            [web.get("/metrics", metrics), web.get("/status", status), web.get("/healthz", healthz)]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as exc:
            raise BadInput(
                f"cannot serve /metrics on {self.host}:{self.port}: {exc.strerror or exc}",
                "pick a free --port (or --host)",
            ) from exc

    # -- the loop -------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to end after the current round."""
        self._stop.set()

    async def run(self, *, once: bool = False, duration_s: float | None = None) -> int:
        """Watch until stopped (or one check with ``once``); the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        if self.port is not None:
            await self._serve()
        for hook in self.outputs.webhooks:
            hook.start()
        try:
            async with aiohttp.ClientSession() as session:
                code = await (self._once(session) if once else self._forever(session, duration_s))
                await self._close_prefix_windows(session)
            for hook in self.outputs.webhooks:
                await hook.drain()
            return code
        finally:
            for hook in self.outputs.webhooks:
                await hook.close()
            if self._runner is not None:
                await self._runner.cleanup()

    async def _once(self, session: aiohttp.ClientSession) -> int:
        """Two rounds ``interval`` apart (preemptions are counted between them)."""
        await self.round(session)
        if not self.targets:
            return EXIT_BAD_INPUT
        await asyncio.sleep(self.interval_s)
        await self.round(session)
        if self.outputs.json is not None:
            self.outputs.json.emit(self.status())
        elif self.outputs.console is not None:
            from oomguard.watch.view import render

            self.outputs.console.print(render(self))
        if self.bad_targets:
            return EXIT_BAD_INPUT
        return EXIT_FIRING if self.tracker.firing() else EXIT_HEALTHY

    async def _forever(self, session: aiohttp.ClientSession, duration_s: float | None) -> int:
        from rich.live import Live

        from oomguard.watch.view import render

        started = time.monotonic()
        live = None
        if self.outputs.live and self.outputs.console is not None:
            live = Live(console=self.outputs.console, auto_refresh=False, transient=False)
            live.start()
        try:
            while not self._stop.is_set():
                tick = time.monotonic()
                await self.round(session)
                if not self.targets:
                    return EXIT_BAD_INPUT
                if live is not None:
                    live.update(render(self), refresh=True)
                if duration_s is not None and time.monotonic() - started >= duration_s:
                    break
                wait_s = max(0.0, self.interval_s - (time.monotonic() - tick))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), wait_s)
        finally:
            if live is not None:
                live.stop()
        return EXIT_FIRING if self.tracker.firing() else EXIT_HEALTHY
