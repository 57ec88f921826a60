"""Admission shared by guard replicas through Redis (``--redis-url``).

Every replica keeps its own requests' progress (their envelopes) in its local
:class:`~oomguard.guard.admission.BackendAdmission`; what the replicas share lives in Redis and
changes only inside the Lua scripts of :mod:`oomguard.guard.shared_lua`, one atomic step each:

* **reserve**: check-and-reserve against every replica's leases, the backend's last snapshot
  and the pause latch; the request becomes a *lease* that expires unless renewed;
* **renew** (every ``renew_interval_s``): the replica rewrites its leases' envelopes (progress
  moves the projection down for everyone) and extends them, so a replica that dies stops
  renewing and its leases come back by themselves within ``lease_s``;
* **snapshot** (every poll of the backend): capacity, effective fraction and KV in use, with
  Redis's own time; a snapshot older than ``snapshot_max_age_s`` counts as a full backend;
* **heartbeat**: the live replicas, counted for the static share.

When Redis cannot be reached, each replica falls back to a **static share** of every backend:
``capacity ÷ replicas`` (the replicas last counted, or ``replicas`` from the configuration),
less what other replicas held beyond their own share when Redis was last seen. It never
fails open: with no count of replicas known it admits nothing (a known gap: admissions other
replicas made after this replica's last view of them, one poll interval or more, are not in
that view). It logs the change, and
``/status`` and ``oomguard_shared_state_up`` show it; sharing resumes once Redis answers again
and every replica has had a renewal period to publish its leases there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from oomguard.guard.admission import BackendAdmission
from oomguard.guard.projection import Footprint, RequestProgress, blocks_now
from oomguard.guard.shared_lua import HEARTBEAT, RELEASE, RENEW, RESERVE, SNAPSHOT

log = logging.getLogger("oomguard.guard")

# A release that a poll may not show yet still counts as the replicas' own (ms).
_RELEASE_GRACE_MS = 500
_MAX_CONNECTIONS = 32


def encode_footprints(fps: Iterable[Footprint]) -> str:
    """``hi,final,remaining,sequences,growth`` per footprint, ``;``-separated."""
    return ";".join(
        f"{f.hi_tokens},{f.final_tokens},"
        f"{-1 if f.remaining_steps is None else f.remaining_steps},{f.sequences},{f.growth}"
        for f in fps
    )


def backend_keys(prefix: str, backend_url: str) -> _BackendKeys:
    """The Redis keys of one backend's shared state (one cluster slot per backend)."""
    tag = hashlib.sha1(backend_url.encode()).hexdigest()[:12]
    base = f"{{{prefix}:{tag}}}"
    return _BackendKeys(f"{base}:leases", f"{base}:data", f"{base}:state", f"{base}:released")


@dataclass
class _BackendKeys:
    leases: str
    data: str
    state: str
    released: str

    @property
    def all(self) -> list[str]:
        return [self.leases, self.data, self.state, self.released]


@dataclass
class SharedView:
    """What the replica last learned from Redis about one backend."""

    paused: bool = False
    full_blocks: int = 0
    leases: int = 0
    projected_peak_blocks: int = 0
    owner_peaks: dict[str, int] = field(default_factory=dict)


class SharedAdmission:
    """One replica's side of the shared admission state (see the module docstring)."""

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        lease_s: float,
        snapshot_max_age_s: float,
        timeout_s: float,
        replicas: int | None,
        watermarks: tuple[float, float, float],
    ) -> None:
        from redis.asyncio import BlockingConnectionPool, Redis

        self.url = url
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self.max_age_ms = int(snapshot_max_age_s * 1000)
        self.renew_interval_s = min(0.1, lease_s / 4)
        self.heartbeat_interval_s = min(0.5, lease_s / 4)
        self.configured_replicas = replicas
        self.high, self.low, self.projected = watermarks
        self.replica_id = uuid.uuid4().hex[:12]
        # A bounded pool: a burst of admissions queues for a connection instead of opening
        # one each (every call is a fraction of a millisecond).
        self.redis = Redis(
            connection_pool=BlockingConnectionPool.from_url(
                url,
                max_connections=_MAX_CONNECTIONS,
                timeout=None,  # a busy pool is not a Redis failure; socket_timeout bounds calls
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
            )
        )
        self._reserve = self.redis.register_script(RESERVE)
        self._release = self.redis.register_script(RELEASE)
        self._renew = self.redis.register_script(RENEW)
        self._snapshot = self.redis.register_script(SNAPSHOT)
        self._heartbeat = self.redis.register_script(HEARTBEAT)
        self.up = False
        self.ever_up = False
        self.last_error: str | None = None
        self.replicas_seen: int | None = None
        self.views: dict[str, SharedView] = {}
        # After an outage: the other replicas known before it, and when Redis came back (its
        # clock); sharing resumes once each has re-registered since (having republished its
        # leases first) or a lease period has passed.
        self.members: set[str] = set()
        self._recovering = False
        self._recover_ms: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.own: dict[str, list[tuple[str, BackendAdmission, RequestProgress]]] = {}
        self.failures = 0

    # -- state ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether admission goes through Redis now (else the static share applies)."""
        return self.up and not self._recovering

    @property
    def replicas(self) -> int | None:
        """Replicas the static share divides by: the configured count, else the last seen."""
        if self.configured_replicas is not None:
            return max(self.configured_replicas, self.replicas_seen or 1)
        return self.replicas_seen

    def keys(self, backend_url: str) -> _BackendKeys:
        """The Redis keys of ``backend_url``'s shared state."""
        return backend_keys(self.prefix, backend_url)

    def _went_down(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        if self.up or not self.ever_up:
            log.warning(
                "Redis %s unreachable (%s): admission falls back to a static share "
                "(capacity / %s replicas)",
                self.url,
                self.last_error,
                self.replicas if self.replicas is not None else "unknown",
            )
        self.up = False

    def _came_up(self) -> None:
        if not self.up:
            if self.ever_up:
                # Redis may have lost the leases, and requests were admitted meanwhile: wait
                # until every replica has republished before sharing again.
                self._recovering = True
                self._recover_ms = None
                log.warning(
                    "Redis %s reachable again: shared admission resumes once every replica "
                    "has republished its leases",
                    self.url,
                )
            self.up = True
            self.ever_up = True
            self.last_error = None

    def _note_members(self, now_ms: int, members: dict[str, int]) -> None:
        """Live replicas (id → last registration, Redis ms); ends a recovery when due."""
        others = {m: beat for m, beat in members.items() if m != self.replica_id}
        if not self._recovering:
            self.members = set(others)
            return
        if self._recover_ms is None:
            self._recover_ms = now_ms
        fresh = {m for m, beat in others.items() if beat >= self._recover_ms}
        waited_out = now_ms - self._recover_ms >= self.lease_ms
        if self.members <= fresh or waited_out:
            self._recovering = False
            self.members = set(others)
            log.warning("Redis %s: every replica republished; admission is shared again", self.url)

    def static_share_blocks(self, backend_url: str, capacity_blocks: int) -> int:
        """This replica's share of ``capacity_blocks`` while Redis is away (0: unknown)."""
        n = self.replicas
        if n is None or n <= 0:
            return 0
        share = capacity_blocks // n
        view = self.views.get(backend_url)
        if view is None:
            return share
        excess = sum(
            max(peak - share, 0)
            for owner, peak in view.owner_peaks.items()
            if owner != self.replica_id
        )
        return max(share - excess, 0)

    # -- the request path ------------------------------------------------------------------
    async def reserve(
        self,
        backend_url: str,
        admission: BackendAdmission,
        progress: RequestProgress,
        now_s: float,
    ) -> bool | None:
        """Check and reserve ``progress`` on the backend atomically; None when Redis failed."""
        k = self.keys(backend_url)
        lease_id = f"{self.replica_id}:{progress.handle}"
        fps = progress.footprints(admission.rate, now_s)
        rate = admission.rate.tokens_per_s or 0.0
        try:
            ok, reason, _margin = await self._reserve(
                keys=k.all,
                args=[
                    lease_id,
                    self.replica_id,
                    self.lease_ms,
                    progress.reserved_blocks,
                    encode_footprints(fps),
                    f"{rate:.3f}",
                    self.high,
                    self.low,
                    self.projected,
                    self.max_age_ms,
                    _RELEASE_GRACE_MS,
                ],
            )
        except Exception as exc:  # any Redis or network failure: the static share decides
            self._went_down(exc)
            return None
        self._came_up()
        view = self.views.setdefault(backend_url, SharedView())
        if reason == b"paused":
            view.paused = True
        return bool(ok)

    async def release(
        self, backend_url: str, admission: BackendAdmission, progress: RequestProgress
    ) -> None:
        """Give the lease back (if Redis is away it expires by itself)."""
        if not self.up:
            return
        k = self.keys(backend_url)
        held = 0
        if admission.block_size is not None:
            held = blocks_now(
                progress.footprints(admission.rate, time.monotonic()), admission.block_size
            )
        try:
            await self._release(keys=k.all, args=[f"{self.replica_id}:{progress.handle}", held])
        except Exception as exc:
            self._went_down(exc)

    # -- background work -------------------------------------------------------------------
    async def snapshot(
        self, backend_url: str, admission: BackendAdmission, observed_blocks: int | None
    ) -> None:
        """Publish one poll of the backend; learn the shared view back."""
        if admission.capacity_blocks is None or admission.block_size is None:
            return
        k = self.keys(backend_url)
        try:
            out = await self._snapshot(
                keys=k.all,
                args=[
                    admission.capacity_blocks,
                    admission.block_size,
                    f"{admission.effective_fraction:.4f}",
                    -1 if observed_blocks is None else observed_blocks,
                    _RELEASE_GRACE_MS,
                    self.max_age_ms,
                ],
            )
        except Exception as exc:
            self._went_down(exc)
            return
        self._came_up()
        view = self.views.setdefault(backend_url, SharedView())
        view.paused = _text(out[0]) == "1"
        view.full_blocks = int(_text(out[1]) or 0)
        view.leases = int(out[2])
        view.projected_peak_blocks = int(out[3])
        view.owner_peaks = {_text(out[i]): int(out[i + 1]) for i in range(4, len(out) - 1, 2)}

    def track(
        self, backend_url: str, admission: BackendAdmission, progress: RequestProgress
    ) -> None:
        """Remember an own request so its lease is renewed until :meth:`forget`."""
        self.own.setdefault(backend_url, []).append(
            (f"{self.replica_id}:{progress.handle}", admission, progress)
        )

    def forget(self, backend_url: str, progress: RequestProgress) -> None:
        """Stop renewing a request's lease."""
        items = self.own.get(backend_url)
        if items:
            self.own[backend_url] = [i for i in items if i[2] is not progress]

    async def renew_once(self) -> None:
        """Rewrite every own lease's envelope and extend it (one script call per backend)."""
        now = time.monotonic()
        for backend_url, items in list(self.own.items()):
            if not items:
                continue
            args: list[Any] = [self.replica_id, self.lease_ms]
            for lease_id, admission, progress in items:
                fps = progress.footprints(admission.rate, now)
                args += [
                    lease_id,
                    f"{admission.rate.tokens_per_s or 0.0:.3f}",
                    progress.reserved_blocks,
                    encode_footprints(fps),
                ]
            try:
                await self._renew(keys=self.keys(backend_url).all[:3], args=args)
            except Exception as exc:
                self._went_down(exc)
                return
            self._came_up()

    async def heartbeat_once(self) -> None:
        """Republish the own leases, then register and count the live replicas (a replica
        that registers has its leases in Redis: recoveries rely on that order)."""
        await self.renew_once()
        ttl_ms = max(self.lease_ms, 3000)
        try:
            out = await self._heartbeat(
                keys=[f"{{{self.prefix}}}:replicas"], args=[self.replica_id, ttl_ms]
            )
        except Exception as exc:
            self._went_down(exc)
            return
        self._came_up()
        now_ms = int(out[0])
        members = {
            _text(out[i]): int(float(out[i + 1])) - ttl_ms for i in range(1, len(out) - 1, 2)
        }
        self._note_members(now_ms, members)
        seen = len(members)
        if self._recovering:  # the replicas known before the outage still count
            seen = max(seen, len(self.members) + 1)
        self.replicas_seen = max(seen, 1)

    async def _loop(self, interval_s: float, step: Any) -> None:
        while True:
            with contextlib.suppress(Exception):
                await step()
            await asyncio.sleep(interval_s)

    async def start(self) -> None:
        """Contact Redis once (the replica count), then renew and heartbeat in the background."""
        await self.heartbeat_once()
        self._tasks = [
            asyncio.create_task(self._loop(self.renew_interval_s, self.renew_once)),
            asyncio.create_task(self._loop(self.heartbeat_interval_s, self.heartbeat_once)),
        ]

    async def stop(self) -> None:
        """Stop the background work and close the connections (leases expire by themselves)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    def status(self) -> dict[str, Any]:
        """The shared state as ``/status`` shows it."""
        return {
            "redis_url": self.url,
            "replica_id": self.replica_id,
            "mode": "shared" if self.active else "static_share",
            "redis_up": self.up,
            "last_error": self.last_error,
            "replicas": self.replicas,
            "lease_s": self.lease_ms / 1000,
            "backends": {
                url: {
                    "paused": v.paused,
                    "leases": v.leases,
                    "full_blocks": v.full_blocks,
                    "projected_peak_blocks": v.projected_peak_blocks,
                    "replica_peaks": v.owner_peaks,
                }
                for url, v in self.views.items()
            },
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
