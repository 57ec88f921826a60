"""The prefix-cache hit rate measured on real vLLM (CPU) and the advice plan draws from it.

`oomguard bench` sends the session's shared tiny server (blocks of 128 tokens, prefix caching
on by default) requests of 400 prompt tokens whose first 300 are the same; vLLM caches whole
blocks, so 256 of each prompt's 400 tokens can come from the cache: a hit rate near 64 %. The
rate bench stores in the calibration store is then what `oomguard plan` cites when it
recommends --enable-prefix-caching.

The store's key names a catalogue GPU (L4) so that plan, which prices a GPU, can address it:
the CPU server has none, and the rate does not depend on one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_vllm_idle
from tinymodel import TinyModel
from vllm_server import VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT_TOKENS, SHARED_TOKENS, MAX_TOKENS, REQUESTS = 400, 300, 4, 24
BLOCK = 128
GPU = "L4"


def _run(exe: list[str], home: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [*exe, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OOMGUARD_HOME": str(home)},
    )
    assert proc.stdout.strip(), f"no JSON; rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return dict(json.loads(proc.stdout))


def test_bench_measures_the_hit_rate_and_plan_recommends_prefix_caching(
    shared_vllm: VllmServer, tiny_model: TinyModel, oomguard_exe: list[str], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    wait_vllm_idle(shared_vllm.base_url)
    bench = _run(
        oomguard_exe,
        home,
        "bench",
        shared_vllm.base_url,
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--shared-prefix",
        str(SHARED_TOKENS),
        "--concurrency",
        "2",
        "--requests",
        str(REQUESTS),
        "--gpu",
        GPU,
        "--budget-s",
        "300",
    )
    wait_vllm_idle(shared_vllm.base_url)
    measured = bench["prefix_cache"]
    print(json.dumps(measured, indent=1))
    assert measured is not None, bench["notes"]
    # every request of the stage was looked up once (the warm-up came before the window)
    assert measured["queries"] == REQUESTS * PROMPT_TOKENS
    assert measured["requests"] == REQUESTS
    full_blocks = SHARED_TOKENS // BLOCK * BLOCK  # 256 tokens of each prompt can hit
    assert measured["hits"] <= REQUESTS * full_blocks
    assert measured["hit_rate"] >= 0.9 * full_blocks / PROMPT_TOKENS
    assert measured["flag"] == "--enable-prefix-caching"
    assert bench["calibration"]["stored"] is True
    stored = bench["calibration"]["prefix_cache"]
    assert stored == {k: measured[k] for k in stored}

    plan = _run(oomguard_exe, home, "plan", str(tiny_model.path), "--gpu", GPU, "--offline")
    advice = plan["prefix_caching"]
    assert advice["enable"] is True and advice["flag"] == "--enable-prefix-caching"
    assert advice["measured"]["hit_rate"] == measured["hit_rate"]
    assert advice["measured"]["requests"] == REQUESTS
    assert advice["source"].startswith(f"bench {shared_vllm.base_url}")
    assert "checklist's 30% line" in advice["reason"]
