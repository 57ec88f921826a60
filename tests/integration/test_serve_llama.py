"""``oomguard serve`` with llama.cpp: the real llama-server on a tiny GGUF, on this CPU.

- a device that runs out of memory while loading: rpc-server (a second ggml device on this CPU,
  what ``-ngl`` offloads to here) under an address-space limit, so that its allocation of the
  buffers of a full split really fails; serve reads the failure line, lowers the split and the
  next launch loads, every buffer it prints equal to the prediction;
- supervision: a SIGKILLed llama-server is restarted, SIGTERM to serve leaves nothing behind;
- bad input (a misspelt llama-server flag, a missing GGUF) refused with one line and exit 2.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from serve_run import ServeRun
from test_llama_cpp_real import llama_server_binary  # noqa: F401  (a fixture)
from tiny_gguf import SHAPES, write_tiny_gguf

from oomguard.engine import EngineProcess
from oomguard.tiering.gguf_file import read_gguf
from oomguard.tiering.server import LlamaServerNotFound, find_llama_server, free_port
from oomguard.tiering.settings import LlamaCppSettings
from oomguard.tiering.split import price_split

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
MIB = 2**20
CTX = 4096


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", SHAPES["q8_0"])


def _rpc_need_bytes(model_path: Path, n_gpu_layers: int) -> int:
    """The predicted buffers on the device (compute at the low end of its range) for ``-ngl n``."""
    settings = LlamaCppSettings(
        ctx_size=CTX, parallel=1, n_gpu_layers=n_gpu_layers, gpu_count=1, gpu_backend="rpc"
    )
    memory = price_split(read_gguf(model_path), settings, 64 * 2**30).memory
    return memory.device_bytes("GPU0", "low")


@pytest.fixture()
def small_device(gguf: Path) -> Iterator[str]:
    """rpc-server whose address space has room for ``-ngl 4`` of this model but not for all five
    layers (RLIMIT_AS set once it runs, above what it has mapped): a device that is too small."""
    try:
        binary = find_llama_server("rpc-server")
    except LlamaServerNotFound as exc:
        from conftest import require_or_skip

        require_or_skip(f"{exc.message} ({exc.hint})")
        raise
    port = free_port()
    proc = EngineProcess([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", "1"])
    proc.start()
    try:
        _wait_port(port)
        full, fewer = _rpc_need_bytes(gguf, -1), _rpc_need_bytes(gguf, 4)
        assert fewer < full
        mapped = psutil.Process(proc.pid).memory_info().vms
        room = (
            mapped + (full + fewer) // 2 + MIB
        )  # the compute buffers print above their range's low end
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (room, room))
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop(grace_s=5.0)


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def _complete(url: str) -> dict[str, object]:
    body = json.dumps({"prompt": "ka to ri", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200
        answer: dict[str, object] = json.loads(resp.read().decode())
    assert answer["choices"]
    return answer


def _serve(oomguard_exe: list[str], args: list[str], tmp_path: Path, binary: Path) -> ServeRun:
    run = ServeRun(
        oomguard_exe,
        ["--llama-server", str(binary), *args],
        home=tmp_path / "home",
        venv=Path(sys.prefix),
        log_dir=tmp_path / "logs",
    )
    return run


def test_serve_heals_a_device_allocation_failure_by_lowering_the_split(
    llama_server_binary: Path,  # noqa: F811
    small_device: str,
    gguf: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    command = [
        "llama-server",
        "-m",
        str(gguf),
        "--rpc",
        small_device,
        "-ngl",
        "all",
        "-c",
        str(CTX),
        "-np",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
    ]
    with _serve(
        oomguard_exe, ["--max-attempts", "4", "--", *command], tmp_path, llama_server_binary
    ) as run:
        ready = run.wait_for("ready", 120)
        failures = run.of_kind("failure")
        assert failures and failures[0]["kind"] == "memory", run.summary()
        assert "failed to allocate RPC0[" in failures[0]["text"]
        heal = run.of_kind("heal")[0]
        assert heal["healed"] and heal["changes"]["split"].startswith("-ngl "), heal
        launches = run.of_kind("launch")
        assert len({tuple(e["argv"]) for e in launches}) == len(launches), (
            "a configuration was launched twice"
        )
        first_ngl = launches[0]["argv"][launches[0]["argv"].index("--n-gpu-layers") + 1]
        last_ngl = launches[-1]["argv"][launches[-1]["argv"].index("--n-gpu-layers") + 1]
        assert first_ngl == "all" and 0 < int(last_ngl) < 5, (first_ngl, last_ngl)
        rows = ready["comparison"]
        assert {r["device"] for r in rows} == {"CPU", "GPU0"}
        assert {r["kind"] for r in rows if r["device"] == "GPU0"} >= {"model", "kv", "compute"}
        assert all(r["in_range"] for r in rows), rows
        assert all(
            r["observed_bytes"] == pytest.approx(r["predicted_bytes"], abs=0.006 * MIB)
            for r in rows
            if not r["estimated"]
        )
        _complete(ready["url"])
        assert run.terminate() == 0
        assert not run.engine_processes_left()


def test_serve_restarts_a_killed_llama_server_and_stops_cleanly(
    llama_server_binary: Path,  # noqa: F811
    gguf: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    args = [str(gguf), "--p99-tokens", "256", "--concurrency", "2", "--port", str(free_port())]
    with _serve(oomguard_exe, args, tmp_path, llama_server_binary) as run:
        plan = run.wait_for("plan", 60)
        assert plan["engine"] == "llama.cpp" and plan["prediction"]["context"]["slots"] == 2
        assert plan["prediction"]["context"]["n_ctx_per_slot"] == 256
        first = run.wait_for("ready", 120)
        assert all(r["in_range"] for r in first["comparison"]), first["comparison"]
        probes = [
            run.wait_for("probe", 120, lambda e, n=name: e.get("probe") == n)
            for name in ("longest", "burst")
        ]
        assert all(p["passed"] for p in probes), probes
        assert probes[0]["prompt_tokens"] == 255 and probes[1]["requests"] == 2
        os.kill(int(first["pid"]), signal.SIGKILL)
        crash = run.wait_for("failure", 60, lambda e: e.get("launch") == first["launch"])
        assert crash["kind"] == "crash", crash
        assert run.wait_for("restart", 60)["healed"] is False
        second = run.wait_for("ready", 120, lambda e: e["launch"] > first["launch"])
        assert second["command"] == first["command"]
        _complete(second["url"])
        serve_pid = run.proc.pid if run.proc else 0
        assert run.terminate() == 0
        assert run.of_kind("exit")[-1]["code"] == 0
        assert not run.engine_processes_left()
        assert not psutil.pid_exists(serve_pid) or psutil.Process(serve_pid).status() == "zombie"


def test_serve_refuses_bad_llama_server_input_with_one_line(
    llama_server_binary: Path,  # noqa: F811
    gguf: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    env = dict(
        os.environ,
        OOMGUARD_HOME=str(tmp_path / "home"),
        OOMGUARD_LLAMA_SERVER=str(llama_server_binary),
    )
    cases = {
        "misspelt flag": (
            ["--", "llama-server", "-m", str(gguf), "--ctx-sise", "512"],
            "not a llama-server flag: --ctx-sise",
        ),
        "missing GGUF": (
            ["--", "llama-server", "-m", str(tmp_path / "none.gguf")],
            "does not exist",
        ),
        "no model": (["--", "llama-server", "-c", "512"], "names no model"),
        "vLLM flag": ([str(gguf), "--max-model-len", "512"], "vLLM flags"),
        "not a GGUF": ([str(tmp_path / "bad.gguf")], "not a readable GGUF"),
    }
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
    for name, (args, words) in cases.items():
        proc = subprocess.run(
            [*oomguard_exe, "serve", "--json", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr)
        assert len(lines) == 1 and words in lines[0], (name, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout, name
        assert '"event": "launch"' not in proc.stdout, name


def test_serve_follows_the_chain_to_llama_cpp(
    llama_server_binary: Path,  # noqa: F811
    gguf: Path,
    oomguard_exe: list[str],
    vllm_venv_path: Path,
    tmp_path: Path,
) -> None:
    """A model vLLM cannot hold on this machine, with its GGUF: plan's chain picks llama.cpp; a
    model vLLM holds stays with vLLM; without vLLM the GGUF is served by llama.cpp."""
    env = dict(
        os.environ,
        OOMGUARD_HOME=str(tmp_path / "home"),
        OOMGUARD_LLAMA_SERVER=str(llama_server_binary),
        OOMGUARD_VLLM_PYTHON=str(vllm_venv_path / "bin" / "python"),
    )
    common = [
        "--gguf",
        str(gguf),
        "--offline",
        "--p99-tokens",
        "1024",
        "--concurrency",
        "2",
        "--dry-run",
        "--json",
    ]
    cases = [
        (["meta-llama/Llama-3.1-70B-Instruct", *common], env, "llama.cpp", "plan: "),
        (["Qwen/Qwen2.5-0.5B-Instruct", *common], env, "vllm", "plan: vLLM holds"),
        (
            ["meta-llama/Llama-3.1-70B-Instruct", *common],
            {**env, "OOMGUARD_VLLM_PYTHON": str(tmp_path / "none")},
            "llama.cpp",
            "no vLLM to launch",
        ),
    ]
    for args, case_env, engine, why in cases:
        proc = subprocess.run(
            [*oomguard_exe, "serve", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=case_env,
            check=False,
        )
        assert proc.returncode == 0, (args, proc.stderr)
        events = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        plan = next(e for e in events if e["event"] == "plan")
        note = next(e for e in events if e["event"] == "note")
        assert plan["engine"] == engine and note["text"].startswith(why), (
            args,
            plan["engine"],
            note,
        )
        if engine == "llama.cpp":
            assert plan["command"].startswith("llama-server --model " + str(gguf))


def test_serve_stops_on_a_host_allocation_failure_and_shows_what_would_serve(
    llama_server_binary: Path,  # noqa: F811
    gguf: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    """llama-server under an address-space limit its KV cache does not fit in: a host buffer has
    no split to lower, so serve exits 1 after showing the alternatives, each priced."""
    limited = tmp_path / "llama-server"  # the real binary, started with `ulimit -v`
    limited.write_text(f'#!/bin/sh\nulimit -v 600000\nexec {llama_server_binary} "$@"\n')
    limited.chmod(0o755)
    command = [
        "llama-server",
        "-m",
        str(gguf),
        "-c",
        "400000",
        "-np",
        "1",
        "--port",
        str(free_port()),
    ]
    with _serve(oomguard_exe, ["--", *command], tmp_path, limited) as run:
        code = run.wait_exit(120)
    assert code == 1, run.summary()
    failure = run.of_kind("failure")[0]
    assert failure["kind"] == "memory" and "failed to allocate CPU buffer" in failure["text"], (
        failure
    )
    heal = run.of_kind("heal")[0]
    assert heal["healed"] is False and "host" in heal["summary"], heal
    alternatives = run.of_kind("alternatives")[0]["alternatives"]
    needed_gib = run.of_kind("plan")[0]["prediction"]["per_device_gib"]["CPU"]
    assert any("q8_0" in a["title"] and a["host_gib"] < needed_gib - 0.3 for a in alternatives), (
        alternatives
    )
    assert len(run.of_kind("launch")) == 1
