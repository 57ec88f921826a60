"""Backend pool: one :class:`Backend` per vLLM server, polled at a sub-second interval.

Each poll reads ``/metrics`` (KV usage, preemptions, queue gauges, ``cache_config_info``) and,
every ``models_refresh_s`` or after a recovery, ``/v1/models`` (served models and their
``max_model_len``). ``eject_after_failures`` failed polls in a row take a backend out of
routing; the first good poll after that brings it back. The proxy may also eject a backend at
once when a connection to it is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from oomguard import vllm_http
from oomguard.guard import llama_backend
from oomguard.guard.admission import AdmissionSettings, BackendAdmission
from oomguard.guard.config import BackendConfig, GuardConfig
from oomguard.guard.llama_backend import SlotLayout
from oomguard.guard.shared import SharedAdmission
from oomguard.guard.tasks import cancel_and_wait
from oomguard.vllm_metrics import VllmSnapshot, parse_vllm_metrics

log = logging.getLogger("oomguard.guard")


class Backend:
    """One upstream server: health, served models, last metrics, admission state."""

    def __init__(self, cfg: BackendConfig, settings: AdmissionSettings) -> None:
        self.url = cfg.url
        self.config = cfg
        self.admission = BackendAdmission(settings)
        if cfg.num_gpu_blocks is not None and cfg.block_size is not None:
            self.admission.set_capacity(cfg.num_gpu_blocks, cfg.block_size)
        self.healthy = False
        self.consecutive_failures = 0
        self.ejections = 0
        self.last_error: str | None = None
        self.models: dict[str, dict[str, Any]] = {}
        self.metrics: VllmSnapshot = VllmSnapshot()
        self.in_flight = 0
        self.tokenize_supported = True
        self.tokenize_retry_at_s = 0.0
        self.next_models_refresh_s = 0.0
        # Restarts: when it went down (monotonic), and the longest restart or startup seen.
        self.down_since_s: float | None = None
        self.ever_healthy = False
        self.longest_restart_s: float | None = None
        self.polls = 0
        self.engine: str | None = None  # "vllm" | "llama.cpp" once known (llama_backend)
        self.llama_layout: SlotLayout | None = None

    def admit_by_slots(self, layout: SlotLayout) -> bool:
        """A llama-server: admit by its slots (watermarks 1.0, no progress tracking); True when
        the layout is new."""
        first = self.llama_layout != layout
        self.engine = llama_backend.LLAMA_CPP
        self.llama_layout = layout
        a = self.admission
        a.settings = dataclasses.replace(
            a.settings,
            high_watermark=1.0,
            low_watermark=1.0,
            projected_watermark=1.0,
            track_mode="off",
            stagger=False,
        )
        a.set_capacity(layout.slots + 1, layout.block_tokens)
        return first

    def note_up(self, now_s: float, wall_now_s: float) -> None:
        """A good poll: learn how long the backend took to come back (restart or startup).

        The time it was seen down is a lower bound of a restart; the server's own
        ``process_start_time_seconds`` gives the whole startup when its process is new.
        """
        took: float | None = None
        if self.down_since_s is not None and self.polls > 0:
            took = now_s - self.down_since_s
            started = self.metrics.process_start_time_s
            down_wall_s = wall_now_s - took
            if started is not None and started >= down_wall_s - 1.0:
                took = max(took, wall_now_s - started)
        if took is not None and took > 0:
            self.longest_restart_s = max(self.longest_restart_s or 0.0, took)
        self.down_since_s = None
        self.ever_healthy = True

    def note_down(self, now_s: float) -> None:
        """A failed poll or connection: remember since when the backend is down."""
        if self.down_since_s is None:
            self.down_since_s = now_s

    @property
    def state(self) -> str:
        """``healthy``, ``unreachable`` (never answered yet) or ``down`` (ejected)."""
        if self.healthy:
            return "healthy"
        return "down" if self.ever_healthy else "unreachable"

    def serves(self, model: str | None) -> bool:
        """Whether this backend can take a request for ``model`` (None: the default model)."""
        return model is None or not self.models or model in self.models

    def max_model_len(self, model: str | None) -> int | None:
        """Context limit for ``model`` here: the config's override, else ``/v1/models``."""
        if self.config.max_model_len is not None:
            return self.config.max_model_len
        entry = self.models.get(model) if model else None
        if entry is None and len(self.models) == 1:
            entry = next(iter(self.models.values()))
        if entry is None:
            return None
        v = entry.get("max_model_len")
        return int(v) if isinstance(v, (int, float)) and v > 0 else None

    def note_max_model_len(self, model: str | None, value: Any) -> None:
        """Record a ``max_model_len`` learned elsewhere (a ``/tokenize`` answer)."""
        if not isinstance(value, int) or value <= 0:
            return
        if model and model in self.models:
            self.models[model].setdefault("max_model_len", value)

    @property
    def capacity_tokens(self) -> int | None:
        a = self.admission
        if a.capacity_blocks is None or a.block_size is None:
            return None
        return a.capacity_blocks * a.block_size

    def snapshot(self, now_s: float) -> dict[str, Any]:
        """State for ``/status`` (``now_s``: the monotonic clock, for the projection)."""
        a = self.admission
        rate = a.rate.tokens_per_s
        return {
            "url": self.url,
            "healthy": self.healthy,
            "state": self.state,
            "last_error": self.last_error,
            "down_for_s": (
                None if self.down_since_s is None else round(now_s - self.down_since_s, 1)
            ),
            "longest_restart_s": (
                None if self.longest_restart_s is None else round(self.longest_restart_s, 1)
            ),
            "models": sorted(self.models),
            "capacity_blocks": a.capacity_blocks,
            "block_size": a.block_size,
            "capacity_tokens": self.capacity_tokens,
            "capacity_source": "config" if self.config.num_gpu_blocks else "metrics",
            "effective_capacity_fraction": round(a.effective_fraction, 4),
            "effective_capacity_blocks": a.effective_capacity_blocks,
            "reserved_blocks": a.reserved_blocks,
            "reserved_tokens": a.reserved_tokens,
            "projected_peak_blocks": a.projected_blocks(now_s),
            "tracked_requests": a.tracked_requests,
            "decode_rate_tokens_per_s": None if rate is None else round(rate, 1),
            "start_latency_s": round(a.rate.start_latency_s, 4),
            "external_blocks": a.external_blocks,
            "utilization": round(a.utilization(), 4),
            "admission_paused": a.paused,
            "in_flight": self.in_flight,
            "kv_cache_usage": self.metrics.kv_cache_usage,
            "preemptions_total": self.metrics.preemptions_total,
            "preemptions_seen": a.preemptions_seen,
            "requests_waiting": self.metrics.requests_waiting,
            "requests_running": self.metrics.requests_running,
            "ejections": self.ejections,
            **llama_backend.status_fields(self),
        }


class _PollError(Exception):
    pass


class BackendPool:
    """All backends, their pollers, and the routing questions the gateway asks."""

    def __init__(
        self,
        config: GuardConfig,
        settings: AdmissionSettings,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.backends = [Backend(b, settings) for b in config.backends]
        self.on_change = on_change
        self.shared: SharedAdmission | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Open the polling session, poll every backend once, then keep polling."""
        self._session = vllm_http.session(
            limit=0,
            timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s),
        )
        await asyncio.gather(*(self.poll_once(b) for b in self.backends))
        self._tasks = [asyncio.create_task(self._poll_loop(b)) for b in self.backends]

    async def stop(self) -> None:
        """Stop polling and close the session."""
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _poll_loop(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self.poll_once(backend)
            except asyncio.CancelledError:
                raise
            except Exception:  # a poller must outlive any surprise in one answer
                log.exception("poll of %s failed unexpectedly", backend.url)

    async def poll_once(self, backend: Backend) -> bool:
        """Poll one backend now; True when it answered well. Updates health and admission."""
        assert self._session is not None
        now = time.monotonic()
        try:
            metrics = await self._fetch_metrics(backend)
            if not backend.healthy or now >= backend.next_models_refresh_s:
                await self._fetch_models(backend)
                backend.next_models_refresh_s = now + self.config.models_refresh_s
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, _PollError) as exc:
            self._poll_failed(backend, f"{type(exc).__name__}: {exc}".strip(": "), now)
            return False
        backend.metrics = metrics
        a = backend.admission
        if (
            backend.config.num_gpu_blocks is None
            and metrics.num_gpu_blocks is not None
            and metrics.block_size is not None
        ):
            a.set_capacity(metrics.num_gpu_blocks, metrics.block_size, metrics.prefix_caching)
        elif metrics.prefix_caching is not None:
            a.prefix_caching = metrics.prefix_caching
        a.observe(metrics.kv_cache_usage, metrics.preemptions_total, now)
        if self.shared is not None:
            observed = None
            if metrics.kv_cache_usage is not None and a.capacity_blocks:
                observed = math.ceil(metrics.kv_cache_usage * a.capacity_blocks)
            await self.shared.snapshot(backend.url, a, observed)
        backend.consecutive_failures = 0
        backend.last_error = None
        if not backend.healthy:
            backend.note_up(now, time.time())
            backend.healthy = True
            log.info("backend %s is healthy", backend.url)
        backend.polls += 1
        self.on_change()
        return True

    async def _fetch_metrics(self, backend: Backend) -> VllmSnapshot:
        assert self._session is not None
        from_llama = await llama_backend.poll(self._session, backend)
        if from_llama is not None:
            return from_llama
        async with self._session.get(backend.url + "/metrics") as resp:
            if resp.status == 404:
                # Not a vLLM server with metrics: fall back to a liveness probe; capacity then
                # has to come from the config.
                async with self._session.get(backend.url + "/health") as h:
                    if h.status != 200:
                        raise _PollError(f"/health answered {h.status}")
                return VllmSnapshot()
            if resp.status != 200:
                raise _PollError(f"/metrics answered {resp.status}")
            text = await resp.text()
        return parse_vllm_metrics(text)

    async def _fetch_models(self, backend: Backend) -> None:
        assert self._session is not None
        async with self._session.get(backend.url + "/v1/models") as resp:
            if resp.status != 200:
                raise _PollError(f"/v1/models answered {resp.status}")
            payload = await resp.json(content_type=None)
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            raise _PollError("/v1/models answered without a 'data' list")
        backend.models = {
            str(m["id"]): m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
        }
        llama_backend.note_models(backend)

    def _poll_failed(self, backend: Backend, reason: str, now_s: float) -> None:
        backend.consecutive_failures += 1
        backend.last_error = reason
        backend.note_down(now_s)
        if backend.polls == 0 and backend.consecutive_failures == 1:
            log.warning("backend %s is unreachable at start: %s", backend.url, reason)
        backend.polls += 1
        if backend.healthy and backend.consecutive_failures >= self.config.eject_after_failures:
            self.eject(backend, reason)

    def eject(self, backend: Backend, reason: str) -> None:
        """Take a backend out of routing until a poll succeeds again."""
        if not backend.healthy:
            return
        backend.healthy = False
        backend.ejections += 1
        backend.last_error = reason
        backend.admission.forget_observations()
        backend.note_down(time.monotonic())
        log.warning("backend %s ejected: %s", backend.url, reason)
        self.on_change()

    # -- questions ----------------------------------------------------------------------
    def candidates(self, model: str | None) -> list[Backend]:
        """Healthy backends that serve ``model``."""
        return [b for b in self.backends if b.healthy and b.serves(model)]

    def all_models(self) -> dict[str, dict[str, Any]]:
        """Every model any backend has listed (healthy or not), by id."""
        out: dict[str, dict[str, Any]] = {}
        for b in self.backends:
            for k, v in b.models.items():
                out.setdefault(k, v)
        return out

    def max_model_len(self, model: str | None) -> int | None:
        """The largest context limit any backend serving ``model`` has for it."""
        values = [
            v
            for b in self.backends
            if b.serves(model) and (v := b.max_model_len(model)) is not None
        ]
        return max(values) if values else None

    def restart_wait_s(self) -> float:
        """How long an accepted request waits for a failed backend: the configured value, or
        twice the longest restart seen here, at least ``restart_wait_min_s``."""
        if self.config.restart_wait_s is not None:
            return self.config.restart_wait_s
        seen = [b.longest_restart_s for b in self.backends if b.longest_restart_s is not None]
        return max(self.config.restart_wait_min_s, 2.0 * max(seen, default=0.0))

    def expected_back_in_s(self, now_s: float) -> float:
        """Seconds until a backend is expected to be healthy again (for ``Retry-After``).

        A backend down for less than its longest restart seen is expected at the end of it;
        otherwise the next polls decide, so the answer is the time they take.
        """
        polls_s = self.config.poll_interval_s * self.config.eject_after_failures
        waits = []
        for b in self.backends:
            if b.down_since_s is not None and b.longest_restart_s is not None:
                waits.append(b.longest_restart_s - (now_s - b.down_since_s))
        remaining = min((w for w in waits if w > 0), default=0.0)
        return max(remaining, polls_s, 1.0)

    def largest_capacity_tokens(self) -> int | None:
        """KV capacity of the largest backend whose capacity is known."""
        values = [c for b in self.backends if (c := b.capacity_tokens) is not None]
        return max(values) if values else None
