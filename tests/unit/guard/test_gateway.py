"""The gateway against a fake vLLM server over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from .conftest import GuardFactory
from .fake_vllm import FakeVllm, start_fake

PROMPT = "one two three four five six seven"  # 7 words + BOS = 8 tokens in the fake


def completion(max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": PROMPT, "max_tokens": max_tokens, **extra}


async def post(
    client: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with client.post(url, data=data, headers=headers or {}) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw) if raw else {}, dict(resp.headers)


async def status(client: aiohttp.ClientSession, guard_url: str) -> dict[str, Any]:
    async with client.get(guard_url + "/status") as resp:
        return await resp.json()


async def wait_status(
    client: aiohttp.ClientSession, guard_url: str, cond: Any, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Poll /status until ``cond(status)`` holds (timing-proof on a loaded machine)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        st = await status(client, guard_url)
        if cond(st):
            return st
        assert asyncio.get_running_loop().time() < deadline, st
        await asyncio.sleep(0.02)


async def test_non_streamed_completion_passes_through(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url])
    code, body, headers = await post(client, guard.url + "/v1/completions", completion(5))
    assert code == 200
    assert body["choices"][0]["text"] == " tok" * 5
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}
    assert headers["x-oomguard-prompt-tokens"] == "exact"
    assert fake.state.tokenize_calls == 1
    st = await status(client, guard.url)
    assert st["backends"][0]["reserved_blocks"] == 0
    assert st["backends"][0]["capacity_blocks"] == 128


async def test_chat_non_streamed_passes_through(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url])
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 3,
    }
    code, out, _ = await post(client, guard.url + "/v1/chat/completions", body)
    assert code == 200
    assert out["choices"][0]["message"]["content"] == " tok tok tok"
    assert out["usage"]["prompt_tokens"] == 8  # 2 words + 4 + 2 in the fake's template


async def read_sse(resp: aiohttp.ClientResponse) -> list[str]:
    events = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            events.append(text[6:])
    return events


async def test_streamed_completion_and_chat_pass_through(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    fake.state.token_rate = 200.0
    guard = await make_guard([fake.url])
    for path, body in (
        ("/v1/completions", completion(6, stream=True)),
        (
            "/v1/chat/completions",
            {
                "model": "fake-model",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 6,
                "stream": True,
            },
        ),
    ):
        async with client.post(guard.url + path, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = await read_sse(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == 6
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    st = await status(client, guard.url)
    assert st["backends"][0]["reserved_blocks"] == 0
    assert st["backends"][0]["in_flight"] == 0


async def test_never_fitting_requests_get_400_with_the_limit(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    small = await start_fake(num_gpu_blocks=33, max_model_len=1024)  # 32 × 16 = 512 tokens
    try:
        guard = await make_guard([small.url])
        code, body, _ = await post(client, guard.url + "/v1/completions", completion(1100))
        assert code == 400
        # Refused on the cheap bound, before tokenizing: at least 1 prompt token + 1100.
        assert "1024" in body["error"]["message"] and "at least 1101" in body["error"]["message"]
        assert small.state.tokenize_calls == 0
        code, body, _ = await post(client, guard.url + "/v1/completions", completion(505))
        assert code == 400 and "513 tokens of KV" in body["error"]["message"]  # exact: 8 + 505
        assert small.state.tokenize_calls == 1
        assert body["error"]["code"] == "context_length_exceeded"
        code, body, _ = await post(client, guard.url + "/v1/completions", completion(600))
        assert code == 400
        assert "512 tokens" in body["error"]["message"]
        code, body, _ = await post(client, guard.url + "/v1/completions", completion(100, n=8))
        assert code == 400 and "8 ×" in body["error"]["message"]
        # Without max_tokens the request may run to the context limit: 1024 > 512 tokens of KV.
        code, body, _ = await post(
            client, guard.url + "/v1/completions", {"model": "fake-model", "prompt": PROMPT}
        )
        assert code == 400
        assert small.state.requests_seen == 0  # nothing reached the backend
        code, _, _ = await post(client, guard.url + "/v1/completions", completion(400))
        assert code == 200
    finally:
        await small.stop()


async def test_client_mistakes_get_openai_style_4xx(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url], max_body_bytes=4096)
    url = guard.url + "/v1/completions"
    cases: list[tuple[Any, dict[str, str], int, str]] = [
        (b"{not json", {}, 400, "not valid JSON"),
        (b"[1, 2]", {}, 400, "JSON object"),
        (b"", {}, 400, "empty"),
        ({"model": "fake-model", "prompt": 5}, {}, 400, "'prompt'"),
        (completion(-1), {}, 400, "max_tokens"),
        (completion(10**12), {}, 400, "max_tokens"),
        ({**completion(5), "max_tokens": "5"}, {}, 400, "integer"),
        ({**completion(5), "stream": "yes"}, {}, 400, "stream"),
        ({**completion(5), "n": 0}, {}, 400, "'n'"),
        ({**completion(5), "model": "nope"}, {}, 404, "nope"),
        (completion(5), {"x-priority": "high"}, 400, "x-priority"),
        (completion(5), {"x-queue-timeout": "-3"}, 400, "x-queue-timeout"),
        ({"model": "fake-model", "prompt": "x " * 5000}, {}, 413, "4096"),
    ]
    for body, headers, want, text in cases:
        code, out, _ = await post(client, url, body, headers)
        assert code == want, (body if isinstance(body, bytes) else str(body)[:80], out)
        err = out["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert text in err["message"], err
    code, out, _ = await post(
        client, guard.url + "/v1/chat/completions", {"model": "fake-model", "messages": []}
    )
    assert code == 400 and out["error"]["param"] == "messages"
    async with client.get(url) as resp:
        assert resp.status == 405
        assert "error" in await resp.json()
    async with client.get(guard.url + "/nowhere") as resp:
        assert resp.status == 404
        assert "error" in await resp.json()
    assert fake.state.requests_seen == 0
    # And the gateway still serves.
    code, _, _ = await post(client, url, completion(2))
    assert code == 200


async def test_overload_excess_gets_429_with_retry_after_and_admitted_complete(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    hold = asyncio.Event()
    slow = await start_fake(hold=hold)
    try:
        guard = await make_guard([slow.url], max_queue_requests=50, queue_timeout_s=60)
        url = guard.url + "/v1/completions"
        # 8 prompt + 120 = 128 tokens = 8 blocks; 128 usable × 0.9 → 14 at once. The upstream
        # holds every admitted request until released, so the split does not depend on timing:
        # 14 running, 50 queued, the other 136 shed at once.
        tasks = [asyncio.create_task(post(client, url, completion(120))) for _ in range(200)]
        await wait_status(
            client,
            guard.url,
            lambda s: s["queue"]["depth"] == 50 and sum(t.done() for t in tasks) == 136,
            timeout_s=60,
        )
        assert slow.state.running == 14
        shed = [t.result() for t in tasks if t.done()]
        assert all(r[0] == 429 for r in shed), [r[0] for r in shed]
        for _, body, headers in shed:
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["code"] == "queue_full"
        hold.set()
        results = await asyncio.gather(*tasks)
        ok = [r for r in results if r[0] == 200]
        assert len(ok) == 64 and len(ok) + len(shed) == 200
        assert all(r[1]["usage"]["completion_tokens"] == 120 for r in ok)
        assert slow.state.preemptions == 0
        assert slow.state.peak_running_blocks <= 0.9 * 128
        assert slow.state.completed == len(ok)
        st = await status(client, guard.url)
        assert st["queue"]["depth"] == 0 and st["backends"][0]["reserved_blocks"] == 0
    finally:
        hold.set()
        await slow.stop()


async def test_queue_timeout_gives_503_with_retry_after(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    slow = await start_fake(delay_s=2.0)
    try:
        guard = await make_guard([slow.url], queue_timeout_s=0.3)
        url = guard.url + "/v1/completions"
        hold = asyncio.create_task(post(client, url, completion(1000)))  # 63 of 128 blocks
        await wait_status(client, guard.url, lambda s: s["backends"][0]["reserved_blocks"] == 63)
        code, body, headers = await post(client, url, completion(1000))
        assert code == 503
        assert body["error"]["code"] == "queue_timeout"
        assert int(headers["Retry-After"]) >= 1
        assert (await hold)[0] == 200
    finally:
        await slow.stop()


async def test_priority_classes_are_served_in_order_for_keys_that_may_set_them(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    # the first request holds the pool until all four are queued (a fixed delay would let it
    # end first on a loaded machine); each later one holds it alone, in the order served
    release = asyncio.Event()
    slow = await start_fake(delay_s=0.05, hold=release)
    try:
        guard = await make_guard(
            [slow.url],
            api_keys=[
                {"name": "ops", "key": "ops-key-123456", "role": "priority"},
                {"name": "app", "key": "app-key-123456"},
            ],
        )
        url = guard.url + "/v1/completions"
        done: list[str] = []
        ops = {"Authorization": "Bearer ops-key-123456"}
        app = {"Authorization": "Bearer app-key-123456"}

        async def run(name: str, headers: dict[str, str], body: dict[str, Any]) -> None:
            code, out, _ = await post(client, url, body, headers)
            assert code == 200, out
            done.append(name)

        def depth(n: int) -> Any:
            return lambda s: s["queue"]["depth"] == n

        hold = asyncio.create_task(run("hold", app, completion(1000)))  # 63 blocks, alone
        await wait_status(client, guard.url, lambda s: s["backends"][0]["reserved_blocks"] == 63)
        tasks = [asyncio.create_task(run("low-1", ops, completion(1000, priority=5)))]
        await wait_status(client, guard.url, depth(1))
        tasks.append(
            asyncio.create_task(run("low-2", {**ops, "x-priority": "5"}, completion(1000)))
        )
        await wait_status(client, guard.url, depth(2))
        # A key without the priority role asks to jump the queue: served at 0, not -1.
        tasks.append(asyncio.create_task(run("app", {**app, "x-priority": "-1"}, completion(1000))))
        await wait_status(client, guard.url, depth(3))
        tasks.append(
            asyncio.create_task(run("high", {**ops, "x-priority": "-1"}, completion(1000)))
        )
        await wait_status(client, guard.url, depth(4))
        release.set()
        await asyncio.gather(hold, *tasks)
        assert done == ["hold", "high", "app", "low-1", "low-2"]
        assert await metric(client, guard.url, "oomguard_priority_ignored_total") == 1
        # Without a key, or with an unknown one: 401, nothing reaches the backend.
        seen = slow.state.requests_seen
        for headers in ({}, {"Authorization": "Bearer nope-nope-nope"}):
            code, out, _ = await post(client, url, completion(2), headers)
            assert code == 401 and out["error"]["type"] == "authentication_error", out
        assert slow.state.requests_seen == seen
    finally:
        await slow.stop()


async def test_without_keys_no_priority_is_honoured(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    slow = await start_fake(delay_s=0.3)
    try:
        guard = await make_guard([slow.url])
        url = guard.url + "/v1/completions"
        done: list[str] = []

        async def run(name: str, headers: dict[str, str]) -> None:
            code, _, _ = await post(client, url, completion(1000), headers)
            assert code == 200
            done.append(name)

        hold = asyncio.create_task(run("hold", {}))
        await wait_status(client, guard.url, lambda s: s["backends"][0]["reserved_blocks"] == 63)
        first = asyncio.create_task(run("first", {}))
        await wait_status(client, guard.url, lambda s: s["queue"]["depth"] == 1)
        jumper = asyncio.create_task(run("jumper", {"x-priority": "-100"}))
        await wait_status(client, guard.url, lambda s: s["queue"]["depth"] == 2)
        await asyncio.gather(hold, first, jumper)
        assert done == ["hold", "first", "jumper"]
    finally:
        await slow.stop()


async def metric(client: aiohttp.ClientSession, guard_url: str, name: str) -> float:
    async with client.get(guard_url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


async def test_client_disconnect_frees_queue_slot_and_reservation(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    slow = await start_fake(delay_s=5.0)
    try:
        guard = await make_guard([slow.url])
        url = guard.url + "/v1/completions"
        running = asyncio.create_task(post(client, url, completion(1000)))
        await wait_status(client, guard.url, lambda s: s["backends"][0]["reserved_blocks"] == 63)
        queued = asyncio.create_task(post(client, url, completion(1000)))
        st = await wait_status(client, guard.url, lambda s: s["queue"]["depth"] == 1)
        assert st["backends"][0]["reserved_blocks"] == 63
        queued.cancel()  # the client goes away while queued
        st = await wait_status(client, guard.url, lambda s: s["queue"]["depth"] == 0, 2.0)
        assert st["queue"]["tokens"] == 0
        running.cancel()  # and while its request runs upstream
        st = await wait_status(
            client, guard.url, lambda s: s["backends"][0]["reserved_blocks"] == 0, 2.0
        )
        assert st["backends"][0]["in_flight"] == 0
        await asyncio.sleep(0.1)
        assert slow.state.running == 0  # the upstream request was cancelled too
        slow.state.delay_s = 0.0
        code, _, _ = await post(client, url, completion(1000), {"x-queue-timeout": "10"})
        assert code == 200
    finally:
        await slow.stop()


async def test_streaming_client_disconnect_releases_reservation(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    fake.state.token_rate = 20.0
    guard = await make_guard([fake.url])
    async with client.post(
        guard.url + "/v1/completions", json=completion(200, stream=True)
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()
    # Leaving the block closed the connection mid-stream.
    await wait_status(client, guard.url, lambda s: s["backends"][0]["reserved_blocks"] == 0, 2.0)
    await asyncio.sleep(0.1)
    assert fake.state.running == 0


async def test_own_routes(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url])
    await post(client, guard.url + "/v1/completions", completion(2))
    async with client.get(guard.url + "/health") as r:
        assert r.status == 200
    async with client.get(guard.url + "/ready") as r:
        assert r.status == 200 and (await r.json())["ready"] is True
    async with client.get(guard.url + "/v1/models") as r:
        models = await r.json()
        assert [m["id"] for m in models["data"]] == ["fake-model"]
    async with client.get(guard.url + "/metrics") as r:
        text = await r.text()
    for name in (
        'oomguard_requests_total{outcome="ok"} 1.0',
        "oomguard_queue_depth_requests 0.0",
        "oomguard_queue_wait_seconds_bucket",
        "oomguard_added_latency_seconds_count 1.0",
        f'oomguard_capacity_blocks{{backend="{fake.url}"}} 128.0',
        f'oomguard_backend_kv_cache_usage{{backend="{fake.url}"}}',
        f'oomguard_backend_preemptions_seen_total{{backend="{fake.url}"}} 0.0',
        "oomguard_admission_paused",
        "oomguard_reserved_tokens",
        "oomguard_retries_total 0.0",
        'oomguard_shed_total{reason="queue_full"} 0.0',
    ):
        assert name in text, name
    st = await status(client, guard.url)
    b = st["backends"][0]
    assert b["healthy"] and b["block_size"] == 16 and b["capacity_tokens"] == 2048
    assert st["watermarks"] == {"high": 0.9, "low": 0.8}


async def test_other_v1_routes_pass_through(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url])
    async with client.post(guard.url + "/v1/embeddings", json={"input": "x"}) as r:
        assert r.status == 404  # the backend's answer, passed on


async def test_preemptions_tighten_capacity_through_the_poller(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url])
    await asyncio.sleep(0.15)
    fake.state.preemptions += 4
    st = await wait_status(client, guard.url, lambda s: s["backends"][0]["preemptions_seen"] > 0)
    b = st["backends"][0]
    assert b["effective_capacity_fraction"] == 0.9
    assert b["preemptions_seen"] == 4
    assert b["effective_capacity_blocks"] == 115


async def test_estimated_prompt_is_flagged(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url], tokenizer="estimate")
    code, _, headers = await post(client, guard.url + "/v1/completions", completion(2))
    assert code == 200 and headers["x-oomguard-prompt-tokens"] == "estimated"
    assert fake.state.tokenize_calls == 0


async def test_5xx_from_backend_is_retried(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url])
    fake.state.fail_next = 2
    code, body, _ = await post(client, guard.url + "/v1/completions", completion(2))
    assert code == 200, body
    assert fake.state.requests_seen == 3
    fake.state.fail_next = 10
    code, body, _ = await post(client, guard.url + "/v1/completions", completion(2))
    assert code == 502 and body["error"]["code"] == "upstream_failed"


async def test_routes_to_backend_with_most_free_kv_and_ejects_dead_one(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    a = await start_fake(delay_s=0.6)
    b = await start_fake(delay_s=0.6, num_gpu_blocks=241)
    try:
        guard = await make_guard([a.url, b.url])
        url = guard.url + "/v1/completions"

        def reserved(x: int, y: int) -> Any:
            return lambda s: [r["reserved_blocks"] for r in s["backends"]] == [x, y]

        first = asyncio.create_task(post(client, url, completion(1000)))  # → b (240 free)
        await wait_status(client, guard.url, reserved(0, 63))
        second = asyncio.create_task(post(client, url, completion(1000)))  # b 177 free > a 128
        await wait_status(client, guard.url, reserved(0, 126))
        third = asyncio.create_task(post(client, url, completion(1000)))  # a 128 > b 114
        await wait_status(client, guard.url, reserved(63, 126))
        assert all(r[0] == 200 for r in await asyncio.gather(first, second, third))
        port = int(a.url.rsplit(":", 1)[1])
        await a.kill()
        await wait_status(
            client, guard.url, lambda s: [x["healthy"] for x in s["backends"]] == [False, True], 15
        )
        a2 = await start_fake(port=port)
        await wait_status(
            client, guard.url, lambda s: [x["healthy"] for x in s["backends"]] == [True, True], 15
        )
        await a2.stop()
    finally:
        await b.stop()
