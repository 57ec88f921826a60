"""Clients of vLLM survive the server closing a pooled keep-alive connection under a request,
and do not resend a request whose fresh connection failed."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from oomguard import vllm_http


async def _server(cut: str) -> tuple[web.AppRunner, str, list[str]]:
    """A POST endpoint that closes a connection under a request without answering: with
    ``cut="reused"`` the second request of every connection (as uvicorn does to a request
    written into a connection it is closing for idleness), with ``cut="always"`` every one."""
    per_connection: dict[int, int] = {}
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        transport = request.transport
        assert transport is not None
        n = per_connection[id(transport)] = per_connection.get(id(transport), 0) + 1
        body = await request.json()
        if cut == "always" or (cut == "reused" and n > 1):
            seen.append(f"cut {body['i']}")
            transport.close()
            return web.Response()  # never reaches the client
        seen.append(f"ok {body['i']}")
        return web.json_response({"i": body["i"]})

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions", seen


async def _post_twice(session: aiohttp.ClientSession, url: str) -> list[int]:
    out = []
    for i in range(2):
        async with session.post(url, json={"i": i}) as resp:
            out.append((await resp.json())["i"])
    return out


async def test_a_request_cut_on_a_reused_connection_is_sent_again() -> None:
    runner, url, seen = await _server("reused")
    try:
        async with vllm_http.session(limit=4) as session:
            assert await _post_twice(session, url) == [0, 1]
    finally:
        await runner.cleanup()
    # the second request went out on the pooled connection, was cut, and went again on a new one
    assert seen == ["ok 0", "cut 1", "ok 1"]


async def test_without_the_retry_the_same_cut_fails_the_request() -> None:
    runner, url, seen = await _server("reused")
    try:
        async with aiohttp.ClientSession(connector=vllm_http.connector(limit=4)) as session:
            with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
                await _post_twice(session, url)
    finally:
        await runner.cleanup()
    assert seen == ["ok 0", "cut 1"]


async def test_a_fresh_connection_that_fails_is_not_sent_again() -> None:
    runner, url, seen = await _server("always")
    try:
        async with vllm_http.session(limit=4) as session:
            with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
                async with session.post(url, json={"i": 0}):
                    pass
    finally:
        await runner.cleanup()
    assert seen == ["cut 0"]


async def test_a_server_that_is_down_is_not_retried() -> None:
    async with vllm_http.session(limit=4) as session:
        with pytest.raises(aiohttp.ClientConnectorError):
            async with session.post("http://127.0.0.1:9/v1/completions", json={}):
                pass
