"""The terminal view shows each server against its plan; the NVML reader stops asking when
NVML is absent."""

from __future__ import annotations

import asyncio
import io

import aiohttp
from rich.console import Console

from oomguard.engine.memory import gpu_memory
from oomguard.watch.alerts import AlertTracker
from oomguard.watch.evaluate import Evaluator
from oomguard.watch.plan_figures import PlanFigures
from oomguard.watch.runner import Outputs, Watch
from oomguard.watch.sampling import GpuReader, Target
from oomguard.watch.view import render

from .loopback import http_server, vllm_page

GIB = 2**30


def test_the_view_shows_the_pool_against_the_plan_and_the_alerts() -> None:
    plan = PlanFigures(
        source="t",
        model="m",
        gpu_name="L4",
        gpu_count=1,
        gpu_total_bytes=22 * GIB,
        requested_bytes=20 * GIB,
        weights_bytes=2 * GIB,
        kv_cache_bytes=16 * GIB,
        kv_cache_tokens=4096,
        gpu_memory_utilization=0.9,
        max_num_seqs=None,
        max_model_len=None,
    )

    async def rounds(url: str) -> Watch:
        target = Target.for_url(url)
        watch = Watch(
            [target], Evaluator({target.name: plan}), AlertTracker(min_duration_s=0), Outputs()
        )
        async with aiohttp.ClientSession() as session:
            await watch.round(session)
        return watch

    with http_server(vllm_page) as (url, _):
        watch = asyncio.run(rounds(url))
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render(watch))
    text = out.getvalue()
    assert url in text and "2,048 (plan 4,096)" in text
    assert "OomguardKvPoolBelowPlan" in text and "the plan said 4,096" in text


def test_the_gpu_reader_stops_asking_without_nvml() -> None:
    reader = GpuReader()
    first = reader.read()
    assert reader.available is (first is not None)
    if gpu_memory() is None:  # this machine has no NVIDIA driver
        assert reader.read() is None and reader.available is False
