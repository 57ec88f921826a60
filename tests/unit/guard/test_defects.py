"""Regression tests for the defects a hostile review found (real HTTP on 127.0.0.1).

A request with 50,000 prompts; no healthy backend; a backend that restarts slower than the
wait; Responses / Messages routes admitted and streamed; a backend unreachable at start.
(Client priorities and API keys: test_gateway.py.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import tracemalloc
from typing import Any

import aiohttp
import pytest

from .conftest import GuardFactory
from .fake_vllm import FakeVllm, start_fake
from .test_failures import free_port, kill, spawn_fake
from .test_gateway import PROMPT, completion, post, status, wait_status


async def test_fifty_thousand_prompts_are_refused_before_any_work(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url], max_body_bytes=4 * 2**20)
    url = guard.url + "/v1/completions"
    huge = json.dumps({"model": "fake-model", "prompt": ["a b"] * 50_000, "max_tokens": 4})
    await post(client, url, huge)  # warm the parser paths before measuring
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(5):
            code, body, _ = await post(client, url, huge)
            assert code == 400
            assert body["error"]["code"] == "too_many_prompts"
            assert "50000 prompts" in body["error"]["message"]
            assert "256" in body["error"]["message"]
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Nothing kept per refused request (a leak of its prompt list would be ~1 MB each).
    assert after - before < 2**20, after - before
    assert fake.state.tokenize_calls == 0 and fake.state.requests_seen == 0


async def test_many_prompts_are_tokenized_with_bounded_concurrency_and_others_pass(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    fake.state.tokenize_delay_s = 0.1
    guard = await make_guard([fake.url], tokenize_concurrency=6, tokenize_concurrency_per_request=3)
    await wait_status(client, guard.url, lambda s: all(b["healthy"] for b in s["backends"]))
    url = guard.url + "/v1/completions"
    # 100 prompts of 1 block each fit the 128-block pool; tokenizing them takes ≥ 3.4 s.
    prompts = [f"{PROMPT} {i}" for i in range(100)]
    big = {"model": "fake-model", "prompt": prompts, "max_tokens": 1}
    bulk = asyncio.create_task(post(client, url, big))
    deadline = time.monotonic() + 30
    while fake.state.tokenize_calls == 0:  # the bulk request is being tokenized
        assert not bulk.done() and time.monotonic() < deadline, "the bulk was not tokenized"
        await asyncio.sleep(0.01)
    # Another client is not stuck behind the 100 tokenize calls (3 at a time): it is
    # answered while the bulk request's prompts are still being tokenized.
    code, _, _ = await post(client, url, completion(2))
    assert code == 200
    assert fake.state.tokenize_calls < 101 and not bulk.done(), fake.state.tokenize_calls
    code, out, _ = await bulk
    assert code == 200, out
    assert fake.state.tokenize_calls == 101
    assert fake.state.tokenize_peak <= 6


async def test_no_healthy_backend_answers_503_at_once_with_retry_after(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    guard = await make_guard([dead], queue_timeout_s=60, poll_interval_s=0.2)
    for path, body in (
        ("/v1/completions", completion(4)),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        t0 = time.monotonic()
        code, out, headers = await post(client, guard.url + path, body)
        assert code == 503
        assert time.monotonic() - t0 < 10  # at once, not after the 60 s queue timeout
        assert out["error"]["code"] == "no_healthy_backend"
        assert "unreachable" in out["error"]["message"] and dead in out["error"]["message"]
        assert int(headers["Retry-After"]) >= 1


async def test_backend_unreachable_at_start_is_logged_and_shown(
    make_guard: GuardFactory, client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="oomguard.guard"):
        guard = await make_guard([dead])
    messages = [r.getMessage() for r in caplog.records]
    assert any("unreachable at start" in m and dead in m for m in messages), messages
    st = await status(client, guard.url)
    b = st["backends"][0]
    assert b["state"] == "unreachable" and not b["healthy"] and b["last_error"]


async def test_restart_longer_than_the_wait_gets_an_explicit_error_not_a_drop(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    port = free_port()
    proc = await spawn_fake(port, "--token-rate", "50")
    try:
        guard = await make_guard([f"http://127.0.0.1:{port}"], restart_wait_s=1.0)
        task = asyncio.create_task(post(client, guard.url + "/v1/completions", completion(100)))
        await wait_status(client, guard.url, lambda s: s["backends"][0]["in_flight"] == 1)
        kill(proc)  # and it does not come back within restart_wait_s
        code, out, headers = await asyncio.wait_for(task, 30)
        assert code == 503
        assert out["error"]["code"] == "backend_restart_timeout"
        assert "restart_wait_s" in out["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
    finally:
        kill(proc)


async def test_default_restart_wait_learns_from_the_restarts_it_sees(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    port = free_port()
    proc = await spawn_fake(port)
    try:
        guard = await make_guard([f"http://127.0.0.1:{port}"], restart_wait_min_s=1.0)
        pool = guard.state.pool
        assert pool.restart_wait_s() == 1.0  # nothing seen yet: the floor
        kill(proc)
        await wait_status(client, guard.url, lambda s: s["backends"][0]["state"] == "down")
        await asyncio.sleep(1.5)
        proc = await spawn_fake(port)
        st = await wait_status(client, guard.url, lambda s: s["backends"][0]["healthy"], 20)
        seen = st["backends"][0]["longest_restart_s"]
        assert seen is not None and seen >= 1.5
        assert pool.restart_wait_s() == pytest.approx(2 * pool.backends[0].longest_restart_s)
    finally:
        kill(proc)


async def _read_events(resp: aiohttp.ClientResponse, first: asyncio.Event) -> list[str]:
    names = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("event: "):
            names.append(text[7:])
            if len(names) == 2:
                first.set()
    return names


@pytest.mark.parametrize(
    ("path", "body", "last"),
    [
        (
            "/v1/responses",
            {"model": "fake-model", "input": PROMPT, "max_output_tokens": 40, "stream": True},
            "response.completed",
        ),
        (
            "/v1/messages",
            {
                "model": "fake-model",
                "max_tokens": 40,
                "stream": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            },
            "message_stop",
        ),
    ],
)
async def test_responses_and_messages_are_admitted_and_streamed_chunk_by_chunk(
    fake: FakeVllm,
    make_guard: GuardFactory,
    client: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    last: str,
) -> None:
    gate = asyncio.Event()
    fake.state.stream_gate = gate
    guard = await make_guard([fake.url])
    first = asyncio.Event()
    async with client.post(guard.url + path, json=body) as resp:
        assert resp.status == 200
        reader = asyncio.create_task(_read_events(resp, first))
        # The first events reach the client while the backend still holds the rest back.
        await asyncio.wait_for(first.wait(), 10)
        st = await status(client, guard.url)
        assert st["backends"][0]["reserved_blocks"] > 0  # admitted: it holds a reservation
        gate.set()
        names = await asyncio.wait_for(reader, 10)
    assert names[-1] == last and len(names) == 42
    st = await wait_status(client, guard.url, lambda s: s["backends"][0]["reserved_blocks"] == 0)
    assert st["backends"][0]["in_flight"] == 0
    # Non-streamed works too, and a never-fitting one is refused before the backend sees it.
    code, out, _ = await post(client, guard.url + path, {**body, "stream": False})
    assert code == 200, out
    key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    code, out, _ = await post(client, guard.url + path, {**body, key: 5000})
    assert code == 400 and out["error"]["code"] == "context_length_exceeded"


async def test_messages_without_max_tokens_and_background_responses_are_refused(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url])
    code, out, _ = await post(
        client, guard.url + "/v1/messages", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert code == 400 and out["error"]["param"] == "max_tokens"
    code, out, _ = await post(
        client, guard.url + "/v1/responses", {"input": "x", "background": True}
    )
    assert code == 400 and out["error"]["param"] == "background"
    assert fake.state.requests_seen == 0


async def test_batch_route_counts_every_conversation(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    small = await start_fake(num_gpu_blocks=33)  # 512 tokens
    try:
        guard = await make_guard([small.url])
        conversation = [{"role": "user", "content": PROMPT}]
        body = {"model": "fake-model", "messages": [conversation] * 6, "max_tokens": 100}
        code, out, _ = await post(client, guard.url + "/v1/chat/completions/batch", body)
        # 6 × (15 + 100) tokens = 6 × 8 blocks = 48 > 32: never fits.
        assert code == 400 and "6 ×" in out["error"]["message"], out
        code, out, _ = await post(
            client, guard.url + "/v1/chat/completions/batch", {**body, "stream": True}
        )
        assert code == 400 and out["error"]["param"] == "stream"
    finally:
        await small.stop()
