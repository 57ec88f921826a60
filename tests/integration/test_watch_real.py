"""``oomguard watch`` against real vLLM on CPU (the session's shared server: tiny model,
2,048-token pool, max_model_len 1024, max_num_seqs 128).

A burst of 32 requests of 180 + 300 tokens fills the pool: ``watch --json`` must emit the KV
alerts and the preemption alert, and their resolved events once the burst is over. The same
burst through ``oomguard guard`` preempts nothing, and the watcher emits no preemption alert.
The watcher compares the server with a plan made by ``oomguard plan`` for the same settings:
the pool is as planned (no ``OomguardKvPoolBelowPlan``), and its ``/metrics`` carries both.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import scenarios
from burst import GuardProcess, make_prompts, run_burst
from conftest import wait_vllm_idle
from tinymodel import ENGINE_ARGS, TinyModel
from vllm_server import VllmServer, free_port

from oomguard.engine import start_group, stop_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# the watcher's settings for a burst that lasts seconds (under 5 s on an idle machine), not minutes
# --no-record: the calibration store of whoever runs the tests is not written
FAST = ["--interval", "0.2", "--min-duration", "0.2", "--preemption-window", "8", "--no-record"]


@pytest.fixture(scope="module")
def plan_file(
    tiny_model: TinyModel, oomguard_exe: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """``oomguard plan`` for the shared server's settings (a GPU-sized stand-in for the node)."""
    from conftest import SHARED_MAX_MODEL_LEN, SHARED_POOL_BLOCKS

    run = subprocess.run(
        [
            *oomguard_exe,
            "plan",
            str(tiny_model.path),
            "--gpu-memory-gib",
            "4",
            "--vllm-version",
            "0.32.0",
            "--kv-cache-memory-bytes",
            str(SHARED_POOL_BLOCKS * scenarios.BLOCK_BYTES),
            "--max-model-len",
            str(SHARED_MAX_MODEL_LEN),
            "--enforce-eager",
            *ENGINE_ARGS,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode in (0, 1), run.stderr
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(run.stdout)
    assert json.loads(run.stdout)["kv_cache_tokens"] == 2048
    return path


@contextmanager
def watching(oomguard_exe: list[str], args: list[str], log: Path) -> Iterator[dict[str, Any]]:
    """Run ``oomguard watch ARGS --json --port N``; yields {"url", "events"} (events filled
    in when the block ends and the watcher was stopped with SIGTERM)."""
    port = free_port()
    out = log.with_suffix(".jsonl")
    with open(out, "w") as stdout, open(log, "w") as stderr:
        proc = start_group(
            [*oomguard_exe, "watch", *args, "--json", "--port", str(port)],
            stdout=stdout,
            stderr=stderr,
        )
    state: dict[str, Any] = {"url": f"http://127.0.0.1:{port}", "events": []}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status = json.loads(
                    urllib.request.urlopen(state["url"] + "/status", timeout=2).read()
                )
                if status["servers"] and all(s["up"] for s in status["servers"]):
                    break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        else:
            pytest.fail(f"watch did not see the server up: {log.read_text()[-2000:]}")
        yield state
    finally:
        stop_group(proc.pid, grace_s=30, leader=proc)
        state["events"] = [
            json.loads(line) for line in out.read_text().splitlines() if line.strip()
        ]
        state["returncode"] = proc.returncode


def _wait_for(state: dict[str, Any], log: Path, predicate: Any, timeout_s: float) -> None:
    """Wait until the JSON lines written so far satisfy ``predicate``."""
    out = log.with_suffix(".jsonl")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        if predicate(events):
            return
        time.sleep(0.5)


def _states(events: list[dict[str, Any]], alert: str) -> list[str]:
    return [e["state"] for e in events if e.get("alert") == alert]


KV_AND_PREEMPTION = ("OomguardKvCacheHigh", "OomguardKvCacheCritical", "OomguardPreemptions")


def _events_so_far(log: Path) -> list[dict[str, Any]]:
    out = log.with_suffix(".jsonl")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _all_fired(events: list[dict[str, Any]]) -> bool:
    return all("firing" in _states(events, a) for a in KV_AND_PREEMPTION)


def _all_resolved(events: list[dict[str, Any]]) -> bool:
    return all(_states(events, a)[-1:] == ["resolved"] for a in KV_AND_PREEMPTION)


def test_burst_raises_kv_and_preemption_alerts_and_the_guard_prevents_them(
    shared_vllm: VllmServer,
    tiny_model: TinyModel,
    plan_file: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    url = shared_vllm.base_url
    model = str(tiny_model.path)
    n = scenarios.GUARD_BURST_REQUESTS
    wait_vllm_idle(url)
    log = tmp_path / "watch-direct.log"
    with watching(oomguard_exe, [url, "--plan", str(plan_file), *FAST], log) as direct_watch:
        metrics = (
            urllib.request.urlopen(direct_watch["url"] + "/metrics", timeout=5).read().decode()
        )
        assert f'oomguard_watch_plan_kv_cache_tokens{{server="{url}"}} 2048.0' in metrics
        assert f'oomguard_watch_kv_cache_tokens{{server="{url}"}} 2048.0' in metrics
        for attempt in range(3):
            prompts = make_prompts(
                tiny_model.path, n, scenarios.GUARD_PROMPT_TOKENS, 1000 + attempt
            )
            direct = run_burst("direct", url, url, model, prompts, scenarios.GUARD_MAX_TOKENS)
            wait_vllm_idle(url)
            _wait_for(direct_watch, log, _all_resolved, timeout_s=60)
            # A watcher starved by a loaded machine can miss a pool that was full for a
            # moment: the burst is sent again (the alerts must fire on one of them).
            if _all_fired(_events_so_far(log)):
                break
    events = direct_watch["events"]
    summary = f"burst: {direct.summary()}\nevents: {json.dumps(events, indent=1)[-4000:]}"
    assert direct.preemptions > 0, summary
    for alert in KV_AND_PREEMPTION:
        assert _states(events, alert) and _states(events, alert)[0] == "firing", (
            f"{alert}\n{summary}"
        )
        assert _states(events, alert)[-1] == "resolved", f"{alert}\n{summary}"
    preempt = next(e for e in events if e.get("alert") == "OomguardPreemptions")
    assert preempt["value"] >= 1 and preempt["server"] == url and preempt["severity"] == "warning"
    assert not _states(events, "OomguardKvPoolBelowPlan"), summary  # the pool is as planned
    assert not _states(events, "OomguardServerDown"), summary

    log = tmp_path / "watch-guarded.log"
    with (
        watching(oomguard_exe, [url, "--plan", str(plan_file), *FAST], log) as guarded_watch,
        GuardProcess([url], tmp_path / "guard.log") as guard,
    ):
        prompts = make_prompts(tiny_model.path, n, scenarios.GUARD_PROMPT_TOKENS, 2000)
        guarded = run_burst(
            "through guard", guard.url, url, model, prompts, scenarios.GUARD_MAX_TOKENS
        )
        wait_vllm_idle(url)
        time.sleep(2)  # two more rounds after the burst
    events = guarded_watch["events"]
    summary = f"burst: {guarded.summary()}\nevents: {json.dumps(events, indent=1)[-4000:]}"
    assert guarded.succeeded == n and guarded.preemptions == 0, summary
    assert not _states(events, "OomguardPreemptions"), summary
