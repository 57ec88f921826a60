"""Admission shared by guard replicas through Redis (``--redis-url``): a capacity ledger.

Each backend's usable KV blocks are split between the replicas in a ledger on Redis
(:mod:`oomguard.guard.shared_lua`). A replica admits requests **locally**, against the part it
*keeps*, with the same rule as a single guard (its :class:`BackendAdmission` sees the kept
blocks as its capacity); no Redis call is on a request's path. Capacity moves between replicas
only through the ledger's atomic scripts, in the background:

* a replica keeps its **fair share** (``capacity ÷ replicas``) while nobody waits, and offers
  what it keeps beyond that;
* a replica whose queue head does not fit publishes what it lacks (its *want*); the ledger
  grants wants oldest first, from the wanting replica's own offer, from free capacity, then
  from the others' offers;
* a replica that sees an older want elsewhere offers everything it keeps but does not use (the
  projected peak of its own requests), and, after ``max_head_bypass`` admissions, admits
  nothing more on that backend until the want is met — so a large request on one replica is
  not starved by a stream of small ones on another;
* every poll publishes the backend's capacity and usage with Redis's clock; KV vLLM reports in
  use beyond every replica's count (traffic that bypasses the guards, a dead replica's
  requests) is claimed out of free capacity, and a stale snapshot grants nothing.

Safety does not depend on Redis being reachable: a replica fills at most what it keeps, only
the replica itself moves capacity out of its kept part (first locally, then in Redis), and
capacity enters it only through the ledger. So the sum over replicas never exceeds the pool
whatever any replica missed. When Redis is unreachable each replica goes on admitting within
what it keeps — its **static share** — and assumes every offer it made was taken; it logs the
change, and ``/status`` and ``oomguard_shared_state_up`` show it. When Redis answers again the
ledger carries on; if Redis lost its data, each replica claims what it keeps back, and nothing
is granted from free capacity until every replica known before has done so (or a lease period
passed).

A replica that stops synchronising (it died) is gone after ``lease_s``: its offers become free
and what it kept stays claimed until vLLM's usage shows its requests gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from oomguard.guard.admission import BackendAdmission, RequestCost
from oomguard.guard.projection import blocks_now
from oomguard.guard.shared_lua import SNAPSHOT, SYNC
from oomguard.guard.tasks import cancel_and_wait

log = logging.getLogger("oomguard.guard")

_MAX_CONNECTIONS = 8
# Estimates of external KV (vLLM's usage beyond the replicas' counts) kept for this long; the
# claim is their least, so admissions a replica has not reported yet do not count.
_EXTERNAL_WINDOW_MS = 1000
# How often a replica synchronises while capacity is in motion (its own want, or another's).
_BUSY_SYNC_INTERVAL_S = 0.02

Backends = Callable[[], Iterable[tuple[str, BackendAdmission]]]


def backend_keys(prefix: str, backend_url: str) -> BackendKeys:
    """The Redis keys of one backend's ledger (one cluster slot per backend)."""
    tag = hashlib.sha1(backend_url.encode()).hexdigest()[:12]
    base = f"{{{prefix}:{tag}}}"
    return BackendKeys(f"{base}:state", f"{base}:members", f"{base}:expect")


@dataclass
class BackendKeys:
    """Keys of one backend's ledger."""

    state: str
    members: str
    expect: str

    @property
    def all(self) -> list[str]:
        return [self.state, self.members, self.expect]


@dataclass
class Budget:
    """This replica's part of one backend's ledger, as it last learned it.

    ``kept`` is exact or an underestimate: it is lowered here before a give reaches Redis, and
    raised only from the ledger's answer.
    """

    kept: int = 0
    offered: int = 0
    free: int = 0
    fair: int = 0
    replicas: int = 0
    # Blocks that older wants of other replicas (and the external claim) still lack, and the
    # oldest such want's stamp (Redis ms): while any, unused kept blocks are offered.
    waiting_elsewhere: int = 0
    oldest_elsewhere: int = 0
    stale: bool = True
    locked: bool = False
    external: int = 0
    # The kept blocks this replica's waiting head needs (0: none); what it lacks is its want.
    target: int = 0
    # Admissions made here while an older want elsewhere waits (bounded by max_head_bypass).
    bypassed: int = 0
    synced: bool = False
    holding: int = 0
    lost_state: bool = False
    # When the last synchronisation attempt ended (monotonic s; None: none yet), and whether
    # admission was held back because that was too long ago.
    attempt_s: float | None = None
    held_for_age: bool = False

    @property
    def wants(self) -> bool:
        """Whether this replica waits for more than it keeps here."""
        return self.target > self.kept


@dataclass
class _SyncArgs:
    give: int
    target: int
    holding: int
    now_blocks: int


def encode_members(ids: Iterable[str]) -> str:
    """Replica ids as the scripts take them (comma-separated)."""
    return ",".join(sorted(ids))


class SharedAdmission:
    """One replica's side of the shared ledger (see the module docstring)."""

    def __init__(
        self,
        url: str,
        prefix: str,
        *,
        lease_s: float,
        snapshot_max_age_s: float,
        timeout_s: float,
        replicas: int | None,
        max_head_bypass: int = 8,
        sync_interval_s: float | None = None,
        settle_s: float | None = None,
    ) -> None:
        from redis.asyncio import BlockingConnectionPool, Redis

        self.url = url
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self.max_age_ms = int(snapshot_max_age_s * 1000)
        self.sync_interval_s = sync_interval_s or min(0.1, lease_s / 4)
        # A fresh ledger grants nothing from free capacity for this long: replicas that held
        # capacity before Redis lost its data reconnect and claim it within it.
        self.settle_ms = int(1000 * (settle_s if settle_s is not None else min(2.0, lease_s / 2)))
        self.configured_replicas = replicas
        self.max_head_bypass = max_head_bypass
        self.replica_id = uuid.uuid4().hex[:12]
        self.redis = Redis(
            connection_pool=BlockingConnectionPool.from_url(
                url,
                max_connections=_MAX_CONNECTIONS,
                timeout=None,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
            )
        )
        self._sync = self.redis.register_script(SYNC)
        self._snapshot = self.redis.register_script(SNAPSHOT)
        self.up = False
        self.ever_up = False
        self.last_error: str | None = None
        self.failures = 0
        self.syncs = 0
        self.budgets: dict[str, Budget] = {}
        self.epochs: dict[str, str] = {}
        self.members: dict[str, set[str]] = {}
        self.backends: Backends = lambda: ()
        self.on_change: Callable[[], None] = lambda: None
        self._wake = asyncio.Event()
        # One synchronisation at a time: each lowers the kept blocks before its call and
        # adopts the ledger's answer after it.
        self._sync_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    # -- state ---------------------------------------------------------------------------
    @property
    def locked(self) -> bool:
        """Whether some backend's ledger is recovering from lost data."""
        return any(b.locked for b in self.budgets.values())

    @property
    def active(self) -> bool:
        """Whether capacity moves between replicas now (else each keeps its static share)."""
        return self.up and not self.locked

    @property
    def mode(self) -> str:
        """``shared``, ``recovering`` (Redis lost its data) or ``static_share`` (unreachable)."""
        if not self.up:
            return "static_share"
        return "recovering" if self.locked else "shared"

    @property
    def replicas(self) -> int | None:
        """Replicas the fair share divides by: the configured count or the live ones."""
        seen = max((b.replicas for b in self.budgets.values()), default=0)
        n = max(self.configured_replicas or 0, seen)
        return n or None

    def keys(self, backend_url: str) -> BackendKeys:
        """The Redis keys of ``backend_url``'s ledger."""
        return backend_keys(self.prefix, backend_url)

    def budget(self, backend_url: str) -> Budget:
        """This replica's budget on ``backend_url`` (created empty)."""
        b = self.budgets.get(backend_url)
        if b is None:
            b = self.budgets[backend_url] = Budget()
        return b

    def static_share_blocks(self, backend_url: str) -> int:
        """Blocks this replica may fill on ``backend_url`` whatever happens to Redis."""
        return self.budget(backend_url).kept

    def admission_share(self, backend_url: str) -> int:
        """The capacity local admission may plan with now (0: admit nothing here now)."""
        b = self.budget(backend_url)
        if b.attempt_s is not None and time.monotonic() - b.attempt_s > self.lease_ms / 2000:
            # This replica has not tried the ledger for half a lease (its event loop was
            # starved): what it keeps may have been reclaimed meanwhile (a lease expiry, or a
            # ledger rebuilt after Redis lost its data). Admit nothing until it has tried again.
            b.held_for_age = True
            self._wake.set()
            return 0
        if self.up and b.stale:
            return 0  # no replica has polled the backend lately: it counts as full
        if self.up and b.waiting_elsewhere > 0 and b.bypassed >= self.max_head_bypass:
            return 0
        return b.kept

    def _went_down(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        if self.up or not self.ever_up:
            kept = ", ".join(f"{u}: {b.kept}" for u, b in self.budgets.items()) or "none yet"
            log.warning(
                "Redis %s unreachable (%s): each replica admits within the KV blocks it keeps "
                "(its static share; here %s)",
                self.url,
                self.last_error,
                kept,
            )
        self.up = False
        for b in self.budgets.values():
            b.waiting_elsewhere = 0  # nothing can be given while Redis is away

    def _came_up(self) -> None:
        if not self.up:
            if self.ever_up:
                log.warning("Redis %s reachable again: capacity is shared again", self.url)
            self.up = True
            self.ever_up = True
            self.last_error = None

    # -- the request path (local, no Redis) -------------------------------------------------
    def note_admitted(self, backend_url: str) -> None:
        """A request was admitted here (counts a bypass of an older want elsewhere)."""
        b = self.budget(backend_url)
        if b.waiting_elsewhere > 0:
            b.bypassed += 1

    def note_released(self, backend_url: str) -> None:
        """A request ended here: offer its blocks soon if another replica waits for them."""
        b = self.budget(backend_url)
        if b.waiting_elsewhere > 0 or b.kept > b.fair:
            self._wake.set()

    def set_wants(self, targets: dict[str, int]) -> None:
        """The kept blocks this replica's waiting head needs, per backend (others: none)."""
        grew = False
        for url in set(self.budgets) | set(targets):
            b = self.budget(url)
            target = max(targets.get(url, 0), 0)
            if target > b.target and target > b.kept:
                grew = True
            b.target = target
        if grew:
            self._wake.set()

    # -- the ledger ------------------------------------------------------------------------
    def _sync_args(self, b: Budget, admission: BackendAdmission, now_s: float) -> _SyncArgs:
        """What to tell the ledger: the give, the want, the holding and the blocks in use."""
        bs = admission.block_size or 1
        fps = admission.footprints(now_s)
        holding = admission.share_held(now_s)
        recent = admission.recent_release_blocks(now_s)
        unused = max(b.kept - holding, 0)
        give = 0
        if b.waiting_elsewhere > 0:
            give = unused
        elif not b.wants and b.kept > b.fair > 0:
            give = max(b.kept - max(b.fair, holding), 0)
        return _SyncArgs(give, b.target, holding, blocks_now(fps, bs) + recent)

    async def sync_backend(self, backend_url: str, admission: BackendAdmission) -> bool:
        """One synchronisation with ``backend_url``'s ledger; False when Redis failed."""
        async with self._sync_lock:
            return await self._sync_backend(backend_url, admission)

    async def _sync_backend(self, backend_url: str, admission: BackendAdmission) -> bool:
        b = self.budget(backend_url)
        args = self._sync_args(b, admission, time.monotonic())
        claim = b.kept
        b.kept -= args.give  # lowered here first: what is given is no longer ours to fill
        try:
            out = await self._sync(
                keys=self.keys(backend_url).all,
                args=[
                    self.replica_id,
                    self.epochs.get(backend_url, ""),
                    claim,
                    args.give,
                    args.target,
                    args.holding,
                    args.now_blocks,
                    self.lease_ms,
                    self.settle_ms,
                    self.configured_replicas or 0,
                    self.max_age_ms,
                    encode_members(self.members.get(backend_url, ())),
                ],
            )
        except Exception as exc:  # any Redis or network failure: keep what is kept
            self._went_down(exc)
            self._attempted(b)
            return False
        self._came_up()
        self.syncs += 1
        self._adopt(backend_url, b, out, args.holding)
        self._attempted(b)
        return True

    def _attempted(self, b: Budget) -> None:
        b.attempt_s = time.monotonic()
        if b.held_for_age:
            b.held_for_age = False
            self.on_change()  # admission held back for the attempt's age may go on

    def _adopt(self, backend_url: str, b: Budget, out: list[Any], holding: int) -> None:
        epoch = _text(out[0])
        before = (b.kept, b.waiting_elsewhere)
        known = self.epochs.get(backend_url)
        if known is not None and known != epoch:
            b.lost_state = True
            log.warning(
                "Redis %s lost the shared state of %s: this replica claims back the %d blocks "
                "it keeps; nothing is granted from free capacity until every replica has",
                self.url,
                backend_url,
                b.kept,
            )
        self.epochs[backend_url] = epoch
        b.kept = int(out[1])
        b.offered = int(out[2])
        b.free = int(out[3])
        b.fair = int(out[4])
        b.replicas = int(out[5])
        b.waiting_elsewhere = int(out[6])
        oldest = int(out[7])
        if oldest != b.oldest_elsewhere:
            b.oldest_elsewhere = oldest
            b.bypassed = 0
        was_locked = b.locked
        b.stale = bool(int(out[8]))
        b.locked = bool(int(out[9]))
        b.external = int(out[10])
        b.holding = holding
        b.synced = True
        self.members[backend_url] = {m for m in _text(out[11]).split(",") if m}
        if was_locked and not b.locked and b.lost_state:
            b.lost_state = False
            log.warning("Redis %s: every replica has claimed its capacity back", self.url)
        if (b.kept, b.waiting_elsewhere) != before:
            self.on_change()

    async def sync_once(self) -> None:
        """Synchronise every backend whose capacity is known."""
        for url, admission in list(self.backends()):
            if not admission.known:
                continue
            if not await self.sync_backend(url, admission):
                return

    async def snapshot(
        self, backend_url: str, admission: BackendAdmission, observed_blocks: int | None
    ) -> None:
        """Publish one poll of the backend (capacity, usage) to its ledger."""
        if admission.capacity_blocks is None or admission.block_size is None:
            return
        try:
            await self._snapshot(
                keys=self.keys(backend_url).all,
                args=[
                    admission.capacity_blocks,
                    admission.block_size,
                    f"{admission.effective_fraction:.4f}",
                    -1 if observed_blocks is None else observed_blocks,
                    self.max_age_ms,
                    self.lease_ms,
                    self.settle_ms,
                    _EXTERNAL_WINDOW_MS,
                ],
            )
        except Exception as exc:
            self._went_down(exc)
            return
        self._came_up()
        b = self.budget(backend_url)
        if b.stale and not b.synced:
            self._wake.set()

    # -- background work -------------------------------------------------------------------
    def _interval_s(self) -> float:
        busy = any(b.wants or b.waiting_elsewhere > 0 for b in self.budgets.values())
        return _BUSY_SYNC_INTERVAL_S if busy else self.sync_interval_s

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s())
            self._wake.clear()
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any surprise
                log.exception("shared admission: synchronisation failed unexpectedly")

    def wake(self) -> None:
        """Synchronise now (not waiting for the interval)."""
        self._wake.set()

    async def start(self) -> None:
        """Synchronise in the background from now on."""
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._loop())]

    async def stop(self) -> None:
        """Stop the background work and close the connections (a lease period later the
        ledger gives this replica's capacity to the others)."""
        await cancel_and_wait(self._tasks)
        self._tasks = []
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    def status(self) -> dict[str, Any]:
        """The shared state as ``/status`` shows it."""
        return {
            "redis_url": self.url,
            "replica_id": self.replica_id,
            "mode": self.mode,
            "redis_up": self.up,
            "last_error": self.last_error,
            "replicas": self.replicas,
            "lease_s": self.lease_ms / 1000,
            "backends": {
                url: {
                    "kept_blocks": b.kept,
                    "offered_blocks": b.offered,
                    "holding_blocks": b.holding,
                    "fair_share_blocks": b.fair,
                    "free_blocks": b.free,
                    "want_blocks": max(b.target - b.kept, 0),
                    "waiting_elsewhere_blocks": b.waiting_elsewhere,
                    "external_blocks": b.external,
                    "replicas": b.replicas,
                    "stale": b.stale,
                    "recovering": b.locked,
                }
                for url, b in self.budgets.items()
            },
        }


def wants_for(
    shared: SharedAdmission,
    candidates: Iterable[tuple[str, BackendAdmission]],
    cost: RequestCost,
    now_s: float,
) -> dict[str, int]:
    """What this replica asks the ledger for so that ``cost`` (its waiting head) fits: the kept
    blocks it needs on the candidate that lacks the fewest (nothing when it would fit what is
    kept and waits for another reason)."""
    best: tuple[int, int, str] | None = None
    for url, a in candidates:
        if not a.known or not a.fits_ever(cost):
            continue
        needed = a.share_needed(cost, now_s)
        lacks = needed - shared.budget(url).kept
        if lacks <= 0:
            return {}
        if best is None or lacks < best[0]:
            best = (lacks, needed, url)
    return {} if best is None else {best[2]: best[1]}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
