"""``oomguard serve`` supervises real vLLM: probes, the guard in front, a SIGKILLed engine
restarted and healthy again, SIGTERM to serve leaving nothing behind; and bad input refused
with one line and exit 2 before anything is launched."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import scenarios
from serve_run import ServeRun
from tinymodel import ENGINE_ARGS, TinyModel
from vllm_server import free_port

from oomguard.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


def _completion(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "ka to ri", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200
        assert json.loads(resp.read().decode())["choices"]


def _wait_ready(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def test_serve_restarts_a_killed_engine_and_stops_cleanly(
    tiny_model: TinyModel, vllm_venv_path: Path, oomguard_exe: list[str], tmp_path: Path
) -> None:
    guard_port = free_port()
    command = [
        "vllm",
        "serve",
        str(tiny_model.path),
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        *ENGINE_ARGS,
        "--kv-cache-memory-bytes",
        str(scenarios.GUARD_KV_BYTES),
    ]
    args = [
        "--guard-port",
        str(guard_port),
        "--p99-tokens",
        "512",
        "--concurrency",
        "2",
        "--",
        *command,
    ]
    with ServeRun(
        oomguard_exe, args, home=tmp_path / "home", venv=vllm_venv_path, log_dir=tmp_path / "logs"
    ) as run:
        first = run.wait_for("ready", 900)
        probes = [
            run.wait_for("probe", 300, lambda e, n=name: e.get("probe") == n)
            for name in ("longest", "burst")
        ]
        assert all(p["passed"] for p in probes), probes
        assert probes[0]["prompt_tokens"] == 1023 and probes[1]["requests"] == 2
        guard = run.wait_for("guard", 120)
        assert guard["healthy"], guard
        _completion(guard["url"], str(tiny_model.path))

        os.kill(int(first["pid"]), signal.SIGKILL)
        crash = run.wait_for("failure", 120, lambda e: e.get("launch") == first["launch"])
        assert crash["kind"] == "crash", crash
        assert run.wait_for("restart", 60)["healed"] is False
        second = run.wait_for("ready", 900, lambda e: e["launch"] > first["launch"])
        assert second["command"] == first["command"]
        _completion(second["url"], str(tiny_model.path))
        # the guard follows the new engine (once its health check has seen it)
        assert _wait_ready(guard["url"], 120), "the guard did not see the restarted engine"
        _completion(guard["url"], str(tiny_model.path))

        serve_pid = run.proc.pid if run.proc else 0
        assert run.terminate() == 0
        assert run.of_kind("exit")[-1]["code"] == 0
        assert not run.engine_processes_left()
        assert not psutil.pid_exists(serve_pid) or psutil.Process(serve_pid).status() == "zombie"


def _run_cli(
    oomguard_exe: list[str], args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*oomguard_exe, "serve", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _engines_with(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if marker in " ".join(proc.info.get("cmdline") or []):
            found.append(proc.info["pid"])
    return found


def test_serve_refuses_bad_input_with_one_line(
    tiny_model: TinyModel, vllm_venv_path: Path, oomguard_exe: list[str], tmp_path: Path
) -> None:
    env = dict(
        os.environ,
        OOMGUARD_HOME=str(tmp_path / "home"),
        OOMGUARD_VLLM_PYTHON=str(vllm_venv_path / "bin" / "python"),
    )
    model = str(tiny_model.path)
    # The session's shared vLLM serves the same model directory: only engines that appear
    # during this test count.
    before = set(_engines_with(model))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    busy_port = busy.getsockname()[1]
    cases = {
        "unknown flag": (
            ["--", "vllm", "serve", model, "--max-modle-len", "512"],
            "not a vLLM flag",
        ),
        "missing model": (
            ["--", "vllm", "serve", str(tmp_path / "no-such-model")],
            "does not exist",
        ),
        "port in use": (["--", "vllm", "serve", model, "--port", str(busy_port)], "in use"),
        "missing vLLM": (
            ["--vllm-python", str(tmp_path / "no-python"), "--", "vllm", "serve", model],
            "no vLLM installation",
        ),
    }
    try:
        for name, (args, words) in cases.items():
            proc = _run_cli(oomguard_exe, args, env)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            expected = EXIT_ENVIRONMENT if name == "missing vLLM" else EXIT_BAD_INPUT
            assert proc.returncode == expected, (name, proc.returncode, proc.stderr)
            assert len(lines) == 1 and words in lines[0], (name, proc.stderr)
            assert "Traceback" not in proc.stderr + proc.stdout, name
            events = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
            assert not [e for e in events if e["event"] == "launch"], (name, events)
    finally:
        busy.close()
    started = set(_engines_with(model)) - before
    assert not started, f"an engine was started for bad input: {sorted(started)}"


def test_serve_plans_first_for_a_model(
    tiny_model: TinyModel, vllm_venv_path: Path, oomguard_exe: list[str], tmp_path: Path
) -> None:
    """``oomguard serve MODEL --p99-tokens … --concurrency …``: the plan's configuration,
    with extra vLLM flags after --, printed with its prediction by --dry-run."""
    env = dict(
        os.environ,
        OOMGUARD_HOME=str(tmp_path / "home"),
        OOMGUARD_VLLM_PYTHON=str(vllm_venv_path / "bin" / "python"),
    )
    proc = _run_cli(
        oomguard_exe,
        [
            str(tiny_model.path),
            "--p99-tokens",
            "512",
            "--concurrency",
            "4",
            "--kv-cache-memory-bytes",
            "64M",
            "--dry-run",
            "--",
            "--load-format",
            "dummy",
            *ENGINE_ARGS,
        ],
        env,
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    planned = next(e for e in events if e["event"] == "plan")
    assert "--max-model-len 512" in planned["command"], planned["command"]
    assert "--load-format dummy" in planned["command"]
    assert planned["prediction"]["fits"] is True
    assert planned["prediction"]["terms"]["max_concurrency"]["value"] >= 4
    assert events[-1]["event"] == "exit" and events[-1]["code"] == 0
