"""Where server-side figures come from: vLLM's page, the guard's /status."""

from __future__ import annotations

from pathlib import Path

from oomguard.bench.server import (
    capacity_from_guard,
    capacity_from_vllm,
    is_local,
    looks_like_guard,
    reading_from_guard,
    reading_from_vllm,
)
from oomguard.vllm_metrics import parse_vllm_metrics

PAGE = Path(__file__).parents[2] / "integration" / "data" / "metrics_vllm_0.32.0_after_burst.txt"


def test_capacity_and_reading_from_a_real_vllm_page() -> None:
    snap = parse_vllm_metrics(PAGE.read_text())
    cap = capacity_from_vllm(snap)
    assert cap is not None
    assert (cap.usable_blocks, cap.block_size, cap.num_gpu_blocks) == (15, 128, 16)
    assert cap.kv_cache_tokens == 2048 and cap.kv_cache_memory_bytes == 1_048_576
    assert cap.kv_bytes_per_token == 512.0 and cap.prefix_caching is True
    reading = reading_from_vllm(snap)
    assert reading.preemptions_total == 1.0 and reading.generation_tokens_total == 3600


def test_reading_from_the_guard_status() -> None:
    status = {
        "backends": [
            {
                "url": "http://a",
                "capacity_blocks": 15,
                "block_size": 128,
                "kv_cache_usage": 0.4,
                "preemptions_total": 3.0,
                "requests_running": 5.0,
                "requests_waiting": 1.0,
            },
            {
                "url": "http://b",
                "capacity_blocks": None,
                "block_size": None,
                "kv_cache_usage": 0.7,
                "preemptions_total": 1.0,
                "requests_running": 2.0,
                "requests_waiting": 0.0,
            },
        ],
        "queue": {"depth": 4},
    }
    assert looks_like_guard(status) and not looks_like_guard({"status": "ok"})
    r = reading_from_guard(status)
    assert (r.kv_usage, r.preemptions_total, r.running, r.waiting, r.gateway_queue) == (
        0.7,
        4.0,
        7.0,
        1.0,
        4.0,
    )
    cap = capacity_from_guard(status)
    assert cap is not None and (cap.usable_blocks, cap.block_size, cap.num_gpu_blocks) == (
        15,
        128,
        16,
    )


def test_local_hosts() -> None:
    assert is_local("http://127.0.0.1:8000") and is_local("http://localhost:1")
    assert not is_local("http://192.0.2.7:8000")


async def test_health_tells_a_bad_answer_from_no_answer_in_time() -> None:
    """A loaded client can miss one timeout on its own, so the stage stops on a bad answer at
    once and on a missing one only when it repeats: the two must be told apart."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from oomguard.bench.server import ServerClient

    codes = iter([200, 503, "slow"])

    async def health(_r: web.Request) -> web.Response:
        code = next(codes)
        if code == "slow":
            await asyncio.sleep(2)
            code = 200
        return web.Response(status=int(code))

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            client = ServerClient(session, url, timeout_s=0.5)
            assert [await client.health() for _ in range(3)] == [True, False, None]
            assert await ServerClient(session, "http://127.0.0.1:9").health() is False
    finally:
        await runner.cleanup()
