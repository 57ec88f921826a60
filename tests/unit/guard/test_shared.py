"""Replicas that share admission through a real redis-server (the capacity ledger in Lua).

Properties: whatever the interleaving of admissions, releases, synchronisations and polls
over three replicas, whatever each replica has missed, and wherever Redis dies (and comes back
empty), the replicas never hold more than the pool together; 1,000 simultaneous admission
attempts never reserve more than it. A replica that stops synchronising is gone after its
lease and its capacity comes back once vLLM shows its requests gone; a stale snapshot grants
nothing; after Redis lost its data nothing is granted until every replica has claimed its own
back; an older want on one replica is served despite a stream of admissions on another; with
Redis gone each replica keeps to its static share and says so; two gateways in front of one
backend do not double-book.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.projection import RequestProgress
from oomguard.guard.shared import SharedAdmission, wants_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from redis_server import RedisServer  # noqa: E402

from .conftest import GuardFactory  # noqa: E402
from .fake_vllm import start_fake
from .test_gateway import completion, post, status, wait_status

BACKEND = "http://127.0.0.1:1"
CAPACITY = 200  # usable blocks
BS = 16


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@dataclass
class Replica:
    """One replica's admission on the shared backend, driven by the test (no HTTP)."""

    shared: SharedAdmission
    adm: BackendAdmission
    held: list[RequestProgress] = field(default_factory=list)

    @classmethod
    def make(cls, url: str, prefix: str, lease_s: float = 30.0, **kw: float) -> Replica:
        shared = SharedAdmission(
            url,
            prefix,
            lease_s=lease_s,
            snapshot_max_age_s=kw.pop("snapshot_max_age_s", 30.0),
            timeout_s=0.5,
            replicas=None,
            settle_s=kw.pop("settle_s", 0.0),
            max_head_bypass=int(kw.pop("max_head_bypass", 8)),
        )
        adm = BackendAdmission(AdmissionSettings(track_mode="off"))
        adm.set_capacity(CAPACITY + 1, BS)
        return cls(shared, adm)

    @property
    def kept(self) -> int:
        return self.shared.budget(BACKEND).kept

    def try_admit(self, blocks: int) -> bool:
        """Admit a request of ``blocks`` here now, as the gateway does; else ask for it."""
        cost = RequestCost(blocks * BS - 1, 1)
        now = time.monotonic()
        self.adm.static_share_blocks = self.shared.admission_share(BACKEND)
        if self.adm.can_admit(cost, now):
            self.held.append(self.adm.reserve(cost, now))
            self.shared.note_admitted(BACKEND)
            self.shared.set_wants({})
            return True
        self.shared.set_wants(wants_for(self.shared, [(BACKEND, self.adm)], cost, now))
        return False

    def release(self, index: int) -> None:
        if self.held:
            self.adm.release(self.held.pop(index % len(self.held)), time.monotonic())
            self.shared.note_released(BACKEND)

    async def sync(self) -> bool:
        return await self.shared.sync_backend(BACKEND, self.adm)

    async def poll(self, observed_blocks: int) -> None:
        await self.shared.snapshot(BACKEND, self.adm, observed_blocks)


async def ledger_total(r: Replica) -> int | None:
    """free + external claim + every replica's kept and offered, as Redis holds them (None:
    no ledger)."""
    from redis.asyncio import Redis

    keys = r.shared.keys(BACKEND)
    client = Redis.from_url(r.shared.url)  # its own connection: Redis may have restarted
    try:
        state = await client.hgetall(keys.state)
        members = await client.hvals(keys.members)
    finally:
        await client.aclose()
    if b"epoch" not in state:
        return None
    owned = sum(int(m.split(b"|")[0]) + int(m.split(b"|")[1]) for m in members)
    total = int(state[b"free"]) + int(state[b"ext"]) + owned
    # Every block of the pool has one owner (until a poll tells a fresh ledger the pool, its
    # claims are a debt of free).
    assert total == int(state[b"cap"]), (total, state)
    return total


async def settle(replicas: list[Replica]) -> None:
    """Synchronise until every replica keeps its fair share (those that came first return
    what they kept beyond it)."""
    for _ in range(3):
        for r in replicas:
            await r.sync()


def running(server: RedisServer) -> bool:
    return server.proc is not None and server.proc.poll() is None


def held_blocks(replicas: list[Replica]) -> int:
    return sum(r.adm.reserved_blocks for r in replicas)


def check_bounds(replicas: list[Replica]) -> None:
    """Each replica fills at most what it keeps; together they hold at most the pool."""
    for r in replicas:
        assert r.adm.reserved_blocks <= r.kept, (r.adm.reserved_blocks, r.kept)
    assert sum(r.kept for r in replicas) <= CAPACITY
    assert held_blocks(replicas) <= CAPACITY


_ORDERS = list(itertools.permutations(range(3)))
_ADMIT = st.tuples(st.just("admit"), st.integers(0, 2), st.sampled_from([3, 20, 45, 70, 90]))
_SYNC_ALL = st.tuples(st.just("sync all"), st.integers(0, 5), st.just(0))
# Redis changes rarely; replicas act often (each strategy listed once more is drawn more).
_OPS = st.one_of(
    _ADMIT,
    _ADMIT,
    st.tuples(st.just("release"), st.integers(0, 2), st.integers(0, 99)),
    st.tuples(st.just("sync"), st.integers(0, 2), st.just(0)),
    # Every replica's background synchronisation, in an order drawn from the permutations.
    _SYNC_ALL,
    _SYNC_ALL,
    st.tuples(st.just("poll"), st.integers(0, 2), st.just(0)),
    st.tuples(st.sampled_from(["kill", "restart"]), st.just(0), st.just(0)),
)


async def _play(server: RedisServer, ops: list[tuple[str, int, int]]) -> None:
    prefix = f"p{uuid.uuid4().hex}"  # a fresh ledger for every example
    replicas = [Replica.make(server.url, prefix) for _ in range(3)]
    try:
        for r in replicas:  # everyone starts with its fair share
            await r.poll(0)
        await settle(replicas)
        for op, i, arg in ops:
            r = replicas[i % 3]
            if op == "admit":
                r.try_admit(arg)
            elif op == "release":
                r.release(arg)
            elif op == "sync":
                await r.sync()
            elif op == "sync all":
                for j in _ORDERS[i % len(_ORDERS)]:
                    await replicas[j].sync()
            elif op == "poll":
                await r.poll(held_blocks(replicas))  # vLLM's usage: what is really held
            elif op == "kill":
                server.kill()
            elif op == "restart":
                server.kill()
                server.start()  # empty: no persistence
            check_bounds(replicas)
            if running(server) and op in ("sync", "poll") and r.shared.up:
                assert await ledger_total(r) in (None, 0, CAPACITY)
    finally:
        for r in replicas:
            await r.shared.stop()
        if not running(server):
            server.start()


@settings(
    max_examples=40,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(_OPS, min_size=5, max_size=120))
def test_replicas_never_hold_more_than_the_pool_whatever_redis_does(
    redis_server: RedisServer, ops: list[tuple[str, int, int]]
) -> None:
    asyncio.run(_play(redis_server, ops))


async def _storm(url: str, prefix: str, sizes: list[int]) -> tuple[int, int | None]:
    replicas = [Replica.make(url, prefix) for _ in range(3)]
    try:
        await replicas[0].poll(0)
        await settle(replicas)

        async def attempt(r: Replica, blocks: int) -> int:
            if r.try_admit(blocks):
                return blocks
            await r.sync()  # ask the ledger for what the request lacks, then try once more
            return blocks if r.try_admit(blocks) else 0

        got = await asyncio.gather(*(attempt(replicas[i % 3], b) for i, b in enumerate(sizes)))
        check_bounds(replicas)
        assert held_blocks(replicas) == sum(got)
        return sum(got), await ledger_total(replicas[0])
    finally:
        for r in replicas:
            await r.shared.stop()


@settings(
    max_examples=5,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(0, 2**32), st.integers(1, 90))
def test_a_thousand_simultaneous_attempts_never_reserve_more_than_the_pool(
    redis_server: RedisServer, seed: int, largest: int
) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, largest) for _ in range(1000)]
    admitted, total = asyncio.run(_storm(redis_server.url, f"k{uuid.uuid4().hex}", sizes))
    assert 0 < admitted <= 0.9 * CAPACITY  # the high watermark of plain reservations
    assert total == CAPACITY  # the ledger still accounts for every block


async def test_a_replica_that_stops_synchronising_is_reclaimed_after_its_lease(
    redis_server: RedisServer,
) -> None:
    prefix = f"lease{uuid.uuid4().hex}"
    dead, alive = (Replica.make(redis_server.url, prefix, lease_s=1.0) for _ in range(2))
    try:
        await alive.poll(0)
        await settle([dead, alive])
        assert dead.kept == alive.kept == CAPACITY // 2
        assert dead.try_admit(80)  # and then it dies: it never synchronises again
        big = 170
        assert not alive.try_admit(big)
        started = time.monotonic()
        while not alive.try_admit(big):
            assert time.monotonic() - started < 10, alive.shared.status()
            # vLLM no longer shows the dead replica's 80 blocks (its requests were aborted).
            await alive.poll(held_blocks([alive]))
            await alive.sync()
            await asyncio.sleep(0.05)
        assert time.monotonic() - started >= 0.9  # not before its lease ran out
        assert await ledger_total(alive) == CAPACITY
    finally:
        await dead.shared.stop()
        await alive.shared.stop()


async def test_a_replica_that_has_not_tried_the_ledger_for_half_a_lease_waits_for_it(
    redis_server: RedisServer,
) -> None:
    """A starved event loop: what the replica keeps may have been reclaimed meanwhile, so it
    admits nothing until its next synchronisation attempt, then goes on (and says so)."""
    prefix = f"age{uuid.uuid4().hex}"
    r = Replica.make(redis_server.url, prefix, lease_s=1.0)
    changes: list[int] = []
    r.shared.on_change = lambda: changes.append(1)
    try:
        await r.poll(0)
        await settle([r])
        assert r.kept > 10 and r.try_admit(10)
        await asyncio.sleep(0.6)  # more than half the lease without an attempt
        assert not r.try_admit(10)
        before = len(changes)
        assert await r.sync()
        assert len(changes) > before  # the held-back admission is pumped again
        assert r.try_admit(10)
    finally:
        await r.shared.stop()


async def test_the_requests_of_a_dead_replica_stay_claimed_while_vllm_shows_them(
    redis_server: RedisServer,
) -> None:
    prefix = f"zombie{uuid.uuid4().hex}"
    dead, alive = (Replica.make(redis_server.url, prefix, lease_s=1.0) for _ in range(2))
    try:
        await alive.poll(0)
        await settle([dead, alive])
        assert dead.try_admit(80)
        await dead.sync()  # it reports them, then dies with them still running in vLLM
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            await alive.poll(80)  # vLLM still shows them
            await alive.sync()
            assert not alive.try_admit(110)  # 110 + 80 would not fit 0.9 of the pool
            await asyncio.sleep(0.05)
        assert alive.shared.budget(BACKEND).external >= 80
    finally:
        await dead.shared.stop()
        await alive.shared.stop()


async def test_stale_snapshot_grants_nothing_and_a_fresh_one_does(
    redis_server: RedisServer,
) -> None:
    r = Replica.make(redis_server.url, f"stale{uuid.uuid4().hex}", snapshot_max_age_s=0.3)
    try:
        await r.sync()
        assert r.kept == 0 and not r.try_admit(2)  # no snapshot at all: nothing known
        await r.poll(0)
        await r.sync()
        assert r.try_admit(2)
        await asyncio.sleep(0.5)
        await r.sync()
        assert r.shared.budget(BACKEND).stale and not r.try_admit(2)  # older than 300 ms
        await r.poll(2)
        await r.sync()
        assert r.try_admit(2)
    finally:
        await r.shared.stop()


async def test_after_redis_lost_its_data_nothing_is_granted_until_every_replica_claimed(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    a, b, c = (Replica.make(server.url, "recover") for _ in range(3))
    try:
        await a.poll(0)
        await settle([a, b])
        assert a.try_admit(60) and b.try_admit(60)
        server.kill()
        assert not await a.sync() and a.shared.mode == "static_share"
        # While Redis is away each keeps to what it kept: 90 % of 100 blocks.
        assert a.try_admit(25) and not a.try_admit(10)
        server.start()  # empty
        # (A connection opened before the restart fails once.)
        assert await c.sync()  # a new replica first: it gets nothing yet (settle is 0 here)
        await c.poll(held_blocks([a, b]))
        assert await a.sync() or await a.sync()
        assert a.shared.mode == "recovering" and a.kept == CAPACITY // 2
        await c.sync()
        assert c.kept == 0  # B has not claimed its blocks yet: nothing is free
        assert await b.sync() or await b.sync()
        for r in (a, b, c):
            await r.sync()
        assert a.shared.mode == "shared"
        check_bounds([a, b, c])
        assert await ledger_total(a) == CAPACITY
    finally:
        for r in (a, b, c):
            await r.shared.stop()
        server.stop()


async def test_an_older_want_is_served_despite_admissions_elsewhere(
    redis_server: RedisServer,
) -> None:
    prefix = f"fair{uuid.uuid4().hex}"
    busy, big = (Replica.make(redis_server.url, prefix, max_head_bypass=3) for _ in range(2))
    try:
        await busy.poll(0)
        await settle([busy, big])
        for _ in range(9):
            assert busy.try_admit(10)  # 90 of its 100 blocks
        assert not big.try_admit(150)  # needs 167 kept blocks: 67 more than its share
        await big.sync()
        bypasses = 0
        for _ in range(40):
            if big.try_admit(150):
                break
            busy.release(0)  # a small request ends on the busy replica ...
            if busy.try_admit(10):  # ... and another arrives there
                bypasses += 1
            await busy.sync()
            await big.sync()
        else:
            pytest.fail(f"the large request was starved: {big.shared.status()}")
        assert bypasses <= 3 + 1  # max_head_bypass (and one before the want was known)
        check_bounds([busy, big])
    finally:
        await busy.shared.stop()
        await big.shared.stop()


async def test_redis_gone_static_share_then_sharing_again(
    tmp_path: Path, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    fake = await start_fake(hold=asyncio.Event())  # 128 usable blocks; requests wait on hold
    try:
        guard = await make_guard(
            [fake.url], redis_url=server.url, replicas=2, redis_timeout_s=0.3, queue_timeout_s=30
        )
        url = guard.url + "/v1/completions"
        st = await wait_status(client, guard.url, lambda s: s["shared_state"]["mode"] == "shared")
        assert st["shared_state"]["redis_up"]
        first = asyncio.create_task(post(client, url, completion(500)))  # 32 blocks
        await wait_status(client, guard.url, lambda s: s["backends"][0]["in_flight"] == 1)
        server.kill()
        # 128 blocks / 2 replicas = 64; 32 are held here: one more 32-block request fits
        # (64 × 0.9 = 57 ≥ 32 + 32 is false → it waits); a 16-block one fits.
        small = asyncio.create_task(post(client, url, completion(240)))  # 16 blocks
        await wait_status(client, guard.url, lambda s: s["backends"][0]["in_flight"] == 2)
        large = asyncio.create_task(post(client, url, completion(500)))
        st = await wait_status(client, guard.url, lambda s: s["queue"]["depth"] == 1)
        shared = st["shared_state"]
        assert shared["mode"] == "static_share" and not shared["redis_up"]
        assert shared["replicas"] == 2 and shared["last_error"]
        async with client.get(guard.url + "/metrics") as r:
            text = await r.text()
        assert "oomguard_shared_state_up 0.0" in text
        assert f'oomguard_static_share_blocks{{backend="{fake.url}"}} 64.0' in text
        server.start()
        await wait_status(client, guard.url, lambda s: s["shared_state"]["mode"] == "shared", 15)
        assert fake.state.hold is not None
        fake.state.hold.set()
        results = await asyncio.wait_for(asyncio.gather(first, small, large), 30)
        assert [r[0] for r in results] == [200, 200, 200]
        assert fake.state.preemptions == 0
    finally:
        if fake.state.hold is not None:
            fake.state.hold.set()
        await fake.stop()
        server.stop()


async def test_two_gateways_on_one_redis_do_not_double_book(
    redis_server: RedisServer, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    fake = await start_fake(delay_s=0.3)  # 128 usable blocks
    try:
        prefix = f"pair{uuid.uuid4().hex}"
        guards = [
            await make_guard([fake.url], redis_url=redis_server.url, redis_prefix=prefix)
            for _ in range(2)
        ]
        for g in guards:
            await wait_status(client, g.url, lambda s: s["shared_state"]["mode"] == "shared")
        # 40 requests of 8 blocks: 320 blocks asked, 115 fit under the 0.9 watermark.
        tasks = [
            asyncio.create_task(
                post(client, guards[i % 2].url + "/v1/completions", completion(120))
            )
            for i in range(40)
        ]
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert [r[0] for r in results] == [200] * 40
        assert fake.state.preemptions == 0
        assert fake.state.peak_running_blocks <= 0.9 * 128
        assert fake.state.peak_running_blocks > 0.5 * 128  # both replicas admitted
        st = await status(client, guards[0].url)
        assert st["shared_state"]["replicas"] == 2
    finally:
        await fake.stop()


async def test_workers_serve_one_port_as_replicas_of_one_store(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    import signal
    import subprocess

    from oomguard.engine import signal_group, start_group

    from .test_failures import free_port, kill, spawn_fake

    fake_port = free_port()
    fake = await spawn_fake(fake_port)
    port = free_port()
    log = open(tmp_path / "guard.log", "wb")  # noqa: SIM115
    guard = start_group(
        [
            sys.executable,
            "-m",
            "oomguard.cli",
            "guard",
            "--backend",
            f"http://127.0.0.1:{fake_port}",
            "--port",
            str(port),
            "--workers",
            "2",
            "--redis-url",
            redis_server.url,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        seen: set[str] = set()
        ok = 0
        deadline = asyncio.get_running_loop().time() + 60
        while (len(seen) < 2 or ok < 10) and asyncio.get_running_loop().time() < deadline:
            try:
                # A new connection each time: the kernel spreads them over the workers.
                async with aiohttp.ClientSession() as session:
                    base = f"http://127.0.0.1:{port}"
                    async with session.get(base + "/status") as r:
                        shared = (await r.json())["shared_state"]
                        if shared["mode"] == "shared":
                            seen.add(shared["replica_id"])
                    code, _, _ = await post(session, base + "/v1/completions", completion(4))
                    ok += code == 200
            except aiohttp.ClientError:
                await asyncio.sleep(0.2)
        assert len(seen) == 2, (seen, (tmp_path / "guard.log").read_text()[-2000:])
        assert ok >= 10
    finally:
        if guard.poll() is None:
            signal_group(guard.pid, signal.SIGTERM)  # the guard must take its workers with it
        guard.wait(20)
        log.close()
        kill(fake)
    # Every worker (and multiprocessing's helper) goes with the parent.
    for _ in range(50):
        leftover = subprocess.run(
            ["pgrep", "-g", str(guard.pid)], capture_output=True, text=True
        ).stdout.split()
        if not leftover:
            break
        await asyncio.sleep(0.1)
    assert not leftover, subprocess.run(
        ["ps", "-o", "pid,args", "-p", ",".join(leftover)], capture_output=True, text=True
    ).stdout
