"""The prefix-cache hit rate measured on real vLLM (CPU) and the advice plan draws from it.

`oomguard bench` sends the session's shared tiny server (blocks of 128 tokens, prefix caching
on by default) requests of 400 prompt tokens whose first 300 are the same; vLLM caches whole
blocks, so 256 of each prompt's 400 tokens can come from the cache: a hit rate near 64 %.
`oomguard watch` follows the server meanwhile. Each stores what it measured in the calibration
store, and `oomguard plan` then recommends --enable-prefix-caching citing the newest
measurement, the watch's.

The store's key names a catalogue GPU (L4) so that plan, which prices a GPU, can address it:
the CPU server has none, and the rate does not depend on one.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_vllm_idle
from test_watch_real import watching
from tinymodel import TinyModel
from vllm_server import VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT_TOKENS, SHARED_TOKENS, MAX_TOKENS, REQUESTS = 400, 300, 4, 24
BLOCK = 128
GPU = "L4"


def _run(exe: list[str], *args: str) -> dict[str, Any]:
    proc = subprocess.run([*exe, *args, "--json"], capture_output=True, text=True, timeout=400)
    assert proc.stdout.strip(), f"no JSON; rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return dict(json.loads(proc.stdout))


def test_bench_and_watch_measure_the_hit_rate_and_plan_recommends_prefix_caching(
    shared_vllm: VllmServer,
    tiny_model: TinyModel,
    oomguard_exe: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OOMGUARD_HOME", str(tmp_path / "home"))
    url, model = shared_vllm.base_url, str(tiny_model.path)
    wait_vllm_idle(url)
    watch_args = [url, "--model", model, "--gpu", GPU, "--offline", "--interval", "0.5"]
    with watching(oomguard_exe, watch_args, tmp_path / "watch.log") as watch:
        bench = _run(
            oomguard_exe,
            "bench",
            url,
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
        wait_vllm_idle(url)
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
    stored = bench["calibration"]["prefix_cache"]
    assert bench["calibration"]["stored"] is True and stored == {k: measured[k] for k in stored}

    # the watch saw the bench's requests and its warm-up (one more request, no hit yet)
    (watched,) = [e for e in watch["events"] if e.get("event") == "prefix_cache"]
    print(json.dumps(watched, indent=1))
    assert watched["stored"] is True and watched["key"].startswith("l4|0.32|tiny-llama|tp1")
    assert watched["queries"] >= measured["queries"] + PROMPT_TOKENS
    assert watched["hits"] >= measured["hits"] and watched["requests"] >= REQUESTS + 1

    plan = _run(oomguard_exe, "plan", model, "--gpu", GPU, "--offline")
    advice = plan["prefix_caching"]
    print(advice["reason"])
    assert advice["enable"] is True and advice["flag"] == "--enable-prefix-caching"
    assert advice["source"] == f"watch {url}"  # the newest measurement
    assert advice["measured"]["hit_rate"] == watched["hit_rate"]
    assert advice["measured"]["requests"] == watched["requests"]
    assert "checklist's 30% line" in advice["reason"]
