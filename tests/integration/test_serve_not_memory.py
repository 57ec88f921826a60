"""A real vLLM engine killed with SIGILL on its first request (fault injection into the real
engine-core process, ``fault_injection.py``): the failure that is not memory.

``oomguard serve`` restarts the first crash (it may be a one-off), sees the restarted engine die
at the same point, and stops with the diagnosis instead of restarting into it, without a memory
change; ``oomguard doctor`` on the engine's log says it is not memory and what to do;
``oomguard watch``, following the same server, raises the alert for an engine that keeps dying.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import scenarios
from fault_injection import sigill_plugin_dir
from serve_run import ServeRun
from test_watch_real import watching
from tinymodel import ENGINE_ARGS, TinyModel
from vllm_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

STARTUP_TIMEOUT_S = 900


def _complete(url: str, model: str) -> None:
    """A completion the engine dies answering (an error or a dropped connection)."""
    body = json.dumps({"model": model, "prompt": "ka to ri", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            pytest.fail(f"the engine answered {resp.status}: the fault was not injected")
    except urllib.error.HTTPError as exc:
        assert exc.code >= 500, exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass


def _watch_sees(watch_url: str, up: bool, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(watch_url + "/status", timeout=2) as resp:
                servers = json.loads(resp.read())["servers"]
            if servers and all(s["up"] is up for s in servers):
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"watch did not see the server {'up' if up else 'down'} in {timeout_s:.0f} s")


def test_sigill_at_the_first_request_is_diagnosed_not_healed(
    tiny_model: TinyModel, vllm_venv_path: Path, oomguard_exe: list[str], tmp_path: Path
) -> None:
    plugin = sigill_plugin_dir(tmp_path / "plugin")
    pythonpath = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        "vllm",
        "serve",
        str(tiny_model.path),
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        str(scenarios.GUARD_KV_BYTES),
        *ENGINE_ARGS,
    ]
    with ServeRun(
        oomguard_exe,
        ["--", *command],
        home=tmp_path / "home",
        venv=vllm_venv_path,
        log_dir=tmp_path / "logs",
        extra_env={"PYTHONPATH": pythonpath},
    ) as run:
        first = run.wait_for("ready", STARTUP_TIMEOUT_S)
        with watching(oomguard_exe, [url, "--interval", "0.5"], tmp_path / "watch.log") as watch:
            _complete(url, str(tiny_model.path))
            crash = run.wait_for("failure", 120, lambda e: e.get("launch") == first["launch"])
            assert run.wait_for("restart", 60)["healed"] is False
            run.wait_for("ready", STARTUP_TIMEOUT_S, lambda e: e["launch"] > first["launch"])
            _watch_sees(watch["url"], up=True)
            _complete(url, str(tiny_model.path))
            code = run.wait_exit(180)
            _watch_sees(watch["url"], up=False)
            time.sleep(2.0)  # a few rounds for the alert to fire
        alerts = _alert_events(tmp_path / "watch.jsonl")

    # serve: restarted once, then stopped on the repeat, with the diagnosis and no memory change
    crashes = run.of_kind("failure")
    assert len(crashes) == 2 and len(run.of_kind("launch")) == 2, run.summary()
    for c in (crash, crashes[1]):
        assert c["kind"] == "crash" and c["point"] == "first request", c
        assert c["not_memory"]["kind"] == "illegal_instruction", c
    assert not run.of_kind("heal"), run.summary()
    assert code == 1
    reason = run.of_kind("exit")[-1]["reason"]
    assert "first request twice" in reason and "illegal instruction (SIGILL)" in reason, reason
    assert not run.engine_processes_left()

    # doctor: not memory, with what to do
    log = crashes[1]["log"]
    proc = subprocess.run(
        [*oomguard_exe, "doctor", log, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr
    report = json.loads(proc.stdout)
    assert report["oom_found"] is False and report["findings"] == []
    assert report["not_memory"]["kind"] == "illegal_instruction"
    assert "Fatal Python error: Illegal instruction" in report["not_memory"]["evidence"]["text"]
    assert any("--dtype float32" in a for a in report["not_memory"]["actions"])

    # watch: the engine that keeps dying
    dying = [a for a in alerts if a["alert"] == "OomguardEngineKeepsDying"]
    assert dying and dying[0]["state"] == "firing" and dying[0]["value"] >= 2, alerts


def _alert_events(path: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("event") == "alert"]
