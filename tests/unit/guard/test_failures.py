"""No accepted request lost: backend crash mid-burst (SIGKILL + restart, or a second backend),
and streamed responses cut mid-way end with an explicit SSE error."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from oomguard.engine import kill_group, start_group

from .conftest import GuardFactory
from .fake_vllm import FakeVllm
from .test_gateway import completion, metric, post, read_sse, status

FAKE = Path(__file__).with_name("fake_vllm.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def spawn_fake(port: int, *args: str) -> subprocess.Popen[bytes]:
    proc = start_group(
        [sys.executable, str(FAKE), "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return proc
        except OSError:
            await asyncio.sleep(0.05)
    kill_group(proc.pid, leader=proc)
    raise RuntimeError("fake server did not start")


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the fake backend (a crash: no graceful shutdown)."""
    if proc.poll() is None:
        kill_group(proc.pid, leader=proc)
    proc.wait()


async def test_sigkill_and_restart_on_same_port_loses_no_request(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    port = free_port()
    args = ("--token-rate", "100")  # 40 tokens → 0.4 s per request
    proc = await spawn_fake(port, *args)
    try:
        guard = await make_guard([f"http://127.0.0.1:{port}"], max_retries=3, restart_wait_s=30)
        url = guard.url + "/v1/completions"
        burst = [asyncio.create_task(post(client, url, completion(40))) for _ in range(30)]
        await asyncio.sleep(0.3)
        kill(proc)
        await asyncio.sleep(0.5)
        proc = await spawn_fake(port, *args)
        results = await asyncio.wait_for(asyncio.gather(*burst), 60)
        assert [r[0] for r in results] == [200] * 30, [r[1] for r in results if r[0] != 200]
        assert all(r[1]["usage"]["completion_tokens"] == 40 for r in results)
        assert await metric(client, guard.url, "oomguard_retries_total") >= 1
        st = await status(client, guard.url)
        assert st["backends"][0]["ejections"] >= 1 and st["backends"][0]["healthy"]
        assert st["backends"][0]["reserved_blocks"] == 0
    finally:
        kill(proc)


async def test_second_backend_takes_over_when_one_is_killed(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    ports = [free_port(), free_port()]
    procs = [await spawn_fake(p, "--token-rate", "100") for p in ports]
    try:
        guard = await make_guard([f"http://127.0.0.1:{p}" for p in ports], max_retries=3)
        url = guard.url + "/v1/completions"
        burst = [asyncio.create_task(post(client, url, completion(40))) for _ in range(30)]
        await asyncio.sleep(0.3)
        kill(procs[0])  # and it does not come back
        results = await asyncio.wait_for(asyncio.gather(*burst), 60)
        assert [r[0] for r in results] == [200] * 30, [r[1] for r in results if r[0] != 200]
        st = await status(client, guard.url)
        assert [b["healthy"] for b in st["backends"]] == [False, True]
    finally:
        for p in procs:
            kill(p)


async def test_stream_cut_after_tokens_ends_with_explicit_sse_error(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    fake.state.token_rate = 200.0
    guard = await make_guard([fake.url])
    async with client.post(
        guard.url + "/v1/completions",
        json=completion(20, stream=True),
        headers={"x-fake-cut-after": "3"},
    ) as resp:
        assert resp.status == 200
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert all("choices" in c for c in chunks[:3])
    err = chunks[3]["error"]
    assert "mid-stream" in err["message"] or "before its last event" in err["message"]
    assert err["type"] == "upstream_error"
    assert await metric(client, guard.url, 'oomguard_requests_total{outcome="stream_error"}') == 1
    st = await status(client, guard.url)
    assert st["backends"][0]["reserved_blocks"] == 0


async def test_stream_killed_before_first_token_is_retried(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    port = free_port()
    proc = await spawn_fake(port, "--delay", "0.5")
    try:
        guard = await make_guard([f"http://127.0.0.1:{port}"], restart_wait_s=30)
        task = asyncio.create_task(
            client.post(guard.url + "/v1/completions", json=completion(5, stream=True))
        )
        await asyncio.sleep(0.2)
        kill(proc)
        proc = await spawn_fake(port)
        resp = await asyncio.wait_for(task, 30)
        async with resp:
            assert resp.status == 200
            events = await read_sse(resp)
        assert events[-1] == "[DONE]" and len(events) == 6
        assert all("error" not in json.loads(e) for e in events[:-1])
    finally:
        kill(proc)
