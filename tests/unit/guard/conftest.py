"""Fixtures: a fake vLLM server and a gateway in front of it, both real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from oomguard.guard import GuardServer, start_guard
from oomguard.guard.config import build_config

from .fake_vllm import FakeVllm, start_fake

GuardFactory = Callable[..., Awaitable[GuardServer]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeVllm]:
    server = await start_fake()
    yield server
    await server.stop()


@pytest.fixture
async def make_guard() -> AsyncIterator[GuardFactory]:
    started: list[GuardServer] = []

    async def _make(backends: list[str], **settings: Any) -> GuardServer:
        # A fake backend on loopback answers a poll in milliseconds; on a loaded 2-core
        # machine it can take over the default second, and a backend wrongly taken for
        # unreachable turns a test of something else into a 503.
        values: dict[str, Any] = {
            "backends": backends,
            "port": 0,
            "poll_interval_s": 0.05,
            "health_timeout_s": 5.0,
        }
        values.update(settings)
        server = await start_guard(build_config(values))
        started.append(server)
        return server

    yield _make
    for s in started:
        await s.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        yield session
