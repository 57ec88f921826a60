"""Replicas that share admission through a real redis-server (Lua check-and-reserve).

Property: 1,000 simultaneous admission attempts spread over three replicas never reserve more
than the backend holds. Leases of a replica that stops renewing come back by themselves; a
stale capacity snapshot counts as a full backend; with Redis gone each replica keeps to its
static share and says so; two gateways in front of one backend do not double-book.
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.shared import SharedAdmission

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


def replica(
    url: str, prefix: str, lease_s: float = 10.0
) -> tuple[SharedAdmission, BackendAdmission]:
    shared = SharedAdmission(
        url,
        prefix,
        lease_s=lease_s,
        snapshot_max_age_s=5.0,
        timeout_s=2.0,
        replicas=None,
        watermarks=(0.9, 0.8, 1.0),
    )
    adm = BackendAdmission(AdmissionSettings(track_mode="off"))
    adm.set_capacity(CAPACITY + 1, BS)
    return shared, adm


async def _attempt(shared: SharedAdmission, adm: BackendAdmission, cost: RequestCost) -> int:
    progress = adm.prepare(cost, 0.0)
    ok = await shared.reserve(BACKEND, adm, progress, 0.0)
    assert ok is not None, shared.last_error
    return progress.reserved_blocks if ok else 0


async def _storm(url: str, prefix: str, sizes: list[int]) -> tuple[int, int, int]:
    replicas = [replica(url, prefix) for _ in range(3)]
    try:
        await replicas[0][0].snapshot(BACKEND, replicas[0][1], 0)
        costs = [RequestCost(blocks * BS - 1, 1) for blocks in sizes]
        got = await asyncio.gather(*(_attempt(*replicas[i % 3], c) for i, c in enumerate(costs)))
        leases = await replicas[0][0].redis.zcard(replicas[0][0].keys(BACKEND).leases)
        full = int(await replicas[0][0].redis.hget(replicas[0][0].keys(BACKEND).state, "full"))
        return sum(got), full, int(leases)
    finally:
        for s, _ in replicas:
            await s.stop()


@settings(
    max_examples=5,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(0, 2**32), st.integers(1, 40))
def test_a_thousand_simultaneous_attempts_never_reserve_more_than_the_pool(
    redis_server: RedisServer, seed: int, largest: int
) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, largest) for _ in range(1000)]
    prefix = f"prop{uuid.uuid4().hex}"  # a fresh state for every example
    admitted, full, leases = asyncio.run(_storm(redis_server.url, prefix, sizes))
    assert 0 < admitted <= 0.9 * CAPACITY  # the high watermark of plain reservations
    assert full == admitted  # Redis's own count agrees with what the replicas were told
    assert leases >= 1


async def test_stale_snapshot_counts_as_full_and_fresh_one_admits(
    redis_server: RedisServer,
) -> None:
    shared, adm = replica(redis_server.url, "stale")
    shared.max_age_ms = 300
    try:
        cost = RequestCost(10, 10)
        assert await _attempt(shared, adm, cost) == 0  # no snapshot at all
        await shared.snapshot(BACKEND, adm, 0)
        assert await _attempt(shared, adm, cost) == 2
        await asyncio.sleep(0.5)
        assert await _attempt(shared, adm, cost) == 0  # older than 300 ms
    finally:
        await shared.stop()


async def test_leases_of_a_replica_that_stops_renewing_come_back(redis_server: RedisServer) -> None:
    dead, dead_adm = replica(redis_server.url, "lease", lease_s=1.0)
    alive, alive_adm = replica(redis_server.url, "lease", lease_s=1.0)
    try:
        await alive.snapshot(BACKEND, alive_adm, 0)
        big = RequestCost(150 * BS - 1, 1)  # 150 of 200 blocks
        assert await _attempt(dead, dead_adm, big) == 150  # and then it never renews
        assert await _attempt(alive, alive_adm, big) == 0
        await asyncio.sleep(1.3)
        await alive.snapshot(BACKEND, alive_adm, 0)
        assert await _attempt(alive, alive_adm, big) == 150
    finally:
        await dead.stop()
        await alive.stop()


async def test_renewal_keeps_leases_and_progress_lowers_the_shared_projection(
    redis_server: RedisServer,
) -> None:
    shared, adm = replica(redis_server.url, "renew", lease_s=1.0)
    try:
        await shared.start()
        await shared.snapshot(BACKEND, adm, 0)
        progress = adm.prepare(RequestCost(100 * BS - 1, 1), 0.0)
        assert await shared.reserve(BACKEND, adm, progress, 0.0)
        adm.register(progress)
        shared.track(BACKEND, adm, progress)
        await asyncio.sleep(1.5)  # past the lease: renewals kept it
        keys = shared.keys(BACKEND)
        assert await shared.redis.zcard(keys.leases) == 1
        shared.forget(BACKEND, progress)
        await shared.release(BACKEND, adm, progress)
        assert await shared.redis.zcard(keys.leases) == 0
        assert int(await shared.redis.hget(keys.state, "full")) == 0
    finally:
        await shared.stop()


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
    import os
    import signal
    import subprocess

    from .test_failures import free_port, kill, spawn_fake

    fake_port = free_port()
    fake = await spawn_fake(fake_port)
    port = free_port()
    log = open(tmp_path / "guard.log", "wb")  # noqa: SIM115
    guard = subprocess.Popen(
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
        start_new_session=True,
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
            os.killpg(guard.pid, signal.SIGTERM)
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


async def test_after_an_outage_sharing_waits_for_every_replica_to_republish(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    a, a_adm = replica(server.url, "recover")
    b, b_adm = replica(server.url, "recover")
    try:
        await a.heartbeat_once()
        await b.heartbeat_once()
        await a.heartbeat_once()
        assert a.active and a.members == {b.replica_id} and a.replicas == 2
        # B holds a lease when Redis dies (and loses everything on its restart).
        await b.snapshot(BACKEND, b_adm, 0)
        progress = b_adm.prepare(RequestCost(100 * BS - 1, 1), 0.0)
        assert await b.reserve(BACKEND, b_adm, progress, 0.0)
        b_adm.register(progress)
        b.track(BACKEND, b_adm, progress)
        server.kill()
        await a.heartbeat_once()
        await b.heartbeat_once()
        assert not a.active and not b.active and a.replicas == 2
        server.start()
        await a.heartbeat_once()
        # Redis answers, but B has not republished its lease yet: A keeps to its share.
        assert a.up and not a.active
        assert a.replicas == 2 and a.static_share_blocks(BACKEND, CAPACITY) == CAPACITY // 2
        await b.heartbeat_once()  # republishes its lease, then registers
        await a.heartbeat_once()
        assert a.active
        keys = a.keys(BACKEND)
        assert await a.redis.zcard(keys.leases) == 1  # B's lease is back in Redis
    finally:
        await a.stop()
        await b.stop()
        server.stop()
