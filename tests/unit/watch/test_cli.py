"""``oomguard watch`` from the command line: bad input is one line and exit 2; --once exits 0
healthy, 1 firing; an unreachable server is watched on (and alerted down)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from oomguard.cli import main

from .loopback import http_server, not_vllm_page, vllm_page


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def watch(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """Run ``oomguard watch ARGS`` in this process (the CLI's own main), capturing its output."""

    def run(*args: str) -> Run:
        capsys.readouterr()
        code = main(["watch", *args])
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def _one_error_line(run: Run) -> str:
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert "Traceback" not in run.stderr
    assert len(lines) == 1, run.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "nothing to watch"),
        (("ftp://x",), "is not a server address"),
        (("http://127.0.0.1:1", "--interval", "0"), "--interval 0 must be positive"),
        (("http://127.0.0.1:1", "http://127.0.0.1:1/"), "given twice"),
        (("http://127.0.0.1:1", "--pid", "1", "--pid", "2"), "2 --pid for 1 servers"),
        (
            (
                "--pid",
                "999999999",
            ),
            "no process with PID",
        ),
        (("http://127.0.0.1:1", "--gpu", "H100"), "--gpu is a plan flag, but no --model"),
        (("http://127.0.0.1:1", "--webhook", "alertmanager:9093"), "is not an http(s) URL"),
        (
            (
                "http://127.0.0.1:1",
                "--model",
                "Qwen/Qwen3-8B",
                "--gpu",
                "H100",
                "--gpu-memory-utilization",
                "2",
                "--offline",
            ),
            "--gpu-memory-utilization 2.0 is outside (0, 1]",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    watch: Callable[..., Run], args: tuple[str, ...], needle: str
) -> None:
    run = watch(*args)
    assert run.returncode == 2
    assert needle in _one_error_line(run)


def test_a_plan_file_that_does_not_parse(watch: Callable[..., Run], tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text("vllm serve …\n")
    run = watch("http://127.0.0.1:1", "--plan", str(bad))
    assert run.returncode == 2
    assert "is not JSON" in _one_error_line(run) and "oomguard plan" in run.stderr


def test_a_url_that_is_not_vllm_is_one_line_and_exit_2(watch: Callable[..., Run]) -> None:
    with http_server(not_vllm_page) as (url, _):
        run = watch(url, "--once", "--interval", "0.2")
    assert run.returncode == 2
    line = _one_error_line(run)
    assert "is not a vLLM server" in line and "no vllm: metric" in line


def test_once_healthy_against_a_vllm_page(watch: Callable[..., Run]) -> None:
    with http_server(vllm_page) as (url, _):
        run = watch(url, "--once", "--json", "--interval", "0.2")
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout.splitlines()[-1])
    assert status["event"] == "status" and status["healthy"] is True
    server = status["servers"][0]
    assert server["up"] and server["kv_cache_tokens"] == 2048 and server["preemptions_total"] == 1.0


def test_an_unreachable_server_is_alerted_and_the_others_watched(watch: Callable[..., Run]) -> None:
    with http_server(vllm_page) as (url, _):
        run = watch(
            url,
            "http://127.0.0.1:1",
            "--json",
            "--interval",
            "0.2",
            "--duration",
            "2",
            "--min-duration",
            "0.5",
        )
    events = [json.loads(line) for line in run.stdout.splitlines()]
    down = [e for e in events if e.get("alert") == "OomguardServerDown"]
    assert [(e["server"], e["state"]) for e in down] == [("http://127.0.0.1:1", "firing")]
    assert "cannot connect" in down[0]["message"]
    assert run.returncode == 1  # still firing when the watch ended


def test_a_not_vllm_url_among_good_ones_is_dropped_and_the_rest_watched(
    watch: Callable[..., Run],
) -> None:
    with http_server(vllm_page) as (good, _), http_server(not_vllm_page) as (bad, _):
        run = watch(good, bad, "--json", "--interval", "0.2", "--duration", "1")
    assert run.returncode == 0, run.stderr
    assert f"{bad} is not a vLLM server" in run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert records == [{"event": "error", "message": _one_error_line(run).removeprefix("error: ")}]


def test_the_guard_url_is_named_as_such(watch: Callable[..., Run]) -> None:
    def guard_page(path: str) -> tuple[int, str]:
        return (
            200,
            '# TYPE oomguard_backend_healthy gauge\noomguard_backend_healthy{backend="x"} 1\n',
        )

    with http_server(guard_page) as (url, _):
        run = watch(url, "--once")
    assert run.returncode == 2 and "oomguard guard" in run.stderr


def test_a_port_in_use_is_one_line(watch: Callable[..., Run]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = watch("http://127.0.0.1:1", "--port", str(port), "--host", "127.0.0.1", "--once")
    assert run.returncode == 2
    assert "cannot serve /metrics on 127.0.0.1:" in _one_error_line(run)


def test_several_pids_are_watched_as_processes(watch: Callable[..., Run]) -> None:
    import os

    run = watch(
        "--pid",
        str(os.getpid()),
        "--pid",
        str(os.getppid()),
        "--once",
        "--json",
        "--interval",
        "0.1",
    )
    status = json.loads(run.stdout.splitlines()[-1])
    assert run.returncode == 0, run.stderr
    assert [s["server"] for s in status["servers"]] == [f"pid:{os.getpid()}", f"pid:{os.getppid()}"]
    assert all(s["up"] and s["host_rss_bytes"] > 0 for s in status["servers"])
