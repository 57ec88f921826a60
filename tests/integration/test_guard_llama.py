"""`oomguard guard` in front of the real llama-server (tiny GGUF, CPU): the burst, the overload
and the bad input of the vLLM suite, and ``oomguard serve`` with the guard in front.

llama-server runs 2 slots of 512 tokens (``-c 1024 -np 2``: a KV pool per slot) with
``--metrics``. It has no KV-usage metric and never preempts; a burst larger than its slots is
deferred into a queue of its own (``llamacpp:requests_deferred``). Through the guard no request
is ever deferred there, no more requests run than there are slots, and every request completes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from burst import GuardProcess
from serve_run import ServeRun
from test_llama_cpp_real import llama_server_binary  # noqa: F401  (a fixture)
from tiny_gguf import SHAPES, write_tiny_gguf

from oomguard.tiering.server import RunningLlamaServer, free_port, running_llama_server
from oomguard.tiering.settings import LlamaCppSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SLOTS = 2
CTX_PER_SLOT = 512
PROMPT = "ka to ri " * 12
MAX_TOKENS = 48
# enough HTTP threads that the sampler's /slots and /metrics are answered during a burst
HTTP_THREADS = ("--metrics", "--threads", "1", "--threads-http", "32")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", SHAPES["q8_0"])


@pytest.fixture(scope="module")
def llama(llama_server_binary: Path, gguf: Path) -> Iterator[RunningLlamaServer]:  # noqa: F811
    settings = LlamaCppSettings(ctx_size=SLOTS * CTX_PER_SLOT, parallel=SLOTS)
    with running_llama_server(
        gguf, settings, binary=llama_server_binary, timeout_s=90, extra=HTTP_THREADS
    ) as server:
        yield server


@pytest.fixture(scope="module")
def guard(
    llama: RunningLlamaServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GuardProcess]:
    root = tmp_path_factory.mktemp("guard")
    config = root / "guard.yaml"
    config.write_text(
        yaml.safe_dump(
            {"backends": [{"url": llama.url, "kv_unified": False}], "max_queue_requests": 64}
        )
    )
    with GuardProcess([], root / "guard.log", ["--config", str(config)]) as process:
        _wait_ready(process.url)
        yield process


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became ready")


class SlotWatch:
    """Samples llama-server's busy slots and deferred requests while a burst runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.max_busy = 0
        self.max_deferred = 0.0
        self.samples = 0  # polls answered (a sampler that saw nothing proves nothing)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlotWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                with urllib.request.urlopen(self.url + "/slots", timeout=2) as resp:
                    slots = json.loads(resp.read())
                with urllib.request.urlopen(self.url + "/metrics", timeout=2) as resp:
                    metrics = resp.read().decode()
            except OSError:
                continue
            self.samples += 1
            self.max_busy = max(self.max_busy, sum(1 for s in slots if s.get("is_processing")))
            for line in metrics.splitlines():
                if line.startswith("llamacpp:requests_deferred "):
                    self.max_deferred = max(self.max_deferred, float(line.split()[1]))


async def _burst(
    url: str, n: int, **body: object
) -> list[tuple[int, dict[str, object], dict[str, str]]]:
    payload = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, **body}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as session:

        async def one() -> tuple[int, dict[str, object], dict[str, str]]:
            async with session.post(url + "/v1/completions", json=payload) as resp:
                return resp.status, await resp.json(content_type=None), dict(resp.headers)

        return await asyncio.gather(*(one() for _ in range(n)))


def test_guard_keeps_a_llama_server_burst_within_its_slots(
    llama: RunningLlamaServer, guard: GuardProcess
) -> None:
    n = 4 * SLOTS
    with SlotWatch(llama.url) as direct:
        answers = asyncio.run(_burst(llama.url, n))
    assert all(status == 200 for status, _, _ in answers)
    assert direct.max_deferred > 0, (
        "the direct burst was not deferred by llama-server: nothing to show"
    )
    with SlotWatch(llama.url) as guarded:
        answers = asyncio.run(_burst(guard.url, n))
    assert [status for status, _, _ in answers] == [200] * n, answers
    assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for _, a, _ in answers)  # type: ignore[index]
    assert guarded.samples >= 3 and 0 < guarded.max_busy <= SLOTS, (
        guarded.samples,
        guarded.max_busy,
    )
    assert guarded.max_deferred == 0, guarded.max_deferred
    with urllib.request.urlopen(guard.url + "/status", timeout=5) as resp:
        backend = json.loads(resp.read())["backends"][0]
    assert backend["engine"] == "llama.cpp" and backend["slots"] == SLOTS
    assert (
        backend["n_ctx_per_slot"] == CTX_PER_SLOT
        and backend["capacity_tokens"] == SLOTS * CTX_PER_SLOT
    )
    assert backend["kv_cache_usage"] is not None and backend["preemptions_total"] is None
    assert any("preemption" in line for line in backend["cannot_see"])


def test_guard_sheds_a_llama_server_overload_with_retry_after(
    llama: RunningLlamaServer, tmp_path: Path
) -> None:
    config = tmp_path / "guard.yaml"
    config.write_text(
        yaml.safe_dump(
            {"backends": [{"url": llama.url, "kv_unified": False}], "max_queue_requests": 2}
        )
    )
    with GuardProcess([], tmp_path / "guard.log", ["--config", str(config)]) as process:
        _wait_ready(process.url)
        answers = asyncio.run(_burst(process.url, 4 * SLOTS))
    statuses = sorted(status for status, _, _ in answers)
    admitted = [a for status, a, _ in answers if status == 200]
    shed = [(a, h) for status, a, h in answers if status == 429]
    assert (
        len(admitted) >= SLOTS and len(shed) >= 1 and len(admitted) + len(shed) == len(answers)
    ), statuses
    assert all(int(h["Retry-After"]) >= 1 for _, h in shed)
    assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for a in admitted)  # type: ignore[index]


def test_guard_refuses_bad_input_for_llama_server_as_for_vllm(guard: GuardProcess) -> None:
    async def post(
        path: str, data: bytes, ctype: str = "application/json"
    ) -> tuple[int, dict[str, object]]:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                guard.url + path, data=data, headers={"Content-Type": ctype}
            ) as resp:
                return resp.status, await resp.json(content_type=None)

    cases = [
        (
            "/v1/completions",
            json.dumps({"prompt": PROMPT, "max_tokens": 2 * CTX_PER_SLOT}).encode(),
            400,
            "context_length_exceeded",
        ),
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": -3}).encode(), 400, None),
        ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode(), 400, None),
        (
            "/v1/completions",
            json.dumps({"prompt": PROMPT, "model": "no-such-model"}).encode(),
            404,
            "model_not_found",
        ),
    ]
    for path, data, want, code in cases:
        status, answer = asyncio.run(post(path, data))
        assert status == want, (data, status, answer)
        error = answer["error"]
        assert isinstance(error, dict) and error["message"], answer
        if code is not None:
            assert error["code"] == code, answer
    status, answer = asyncio.run(
        post(
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode(),
        )
    )
    assert status == 200 and answer["choices"], answer


def test_guard_streams_from_llama_server(guard: GuardProcess) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 6, "stream": True}).encode()
    request = urllib.request.Request(
        guard.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0].get("text")) >= 1


def test_serve_starts_llama_server_and_it_answers_through_the_guard(
    llama_server_binary: Path,  # noqa: F811
    gguf: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    args = [
        "--engine",
        "llama.cpp",
        "--llama-server",
        str(llama_server_binary),
        "--guard-port",
        str(free_port()),
        str(gguf),
        "--p99-tokens",
        "256",
        "--concurrency",
        "2",
        "--port",
        str(free_port()),
    ]
    with ServeRun(
        oomguard_exe, args, home=tmp_path / "home", venv=Path(sys.prefix), log_dir=tmp_path / "logs"
    ) as run:
        run.wait_for("ready", 120)
        guard = run.wait_for("guard", 120)
        assert guard["healthy"], guard
        _wait_ready(guard["url"])
        answers = asyncio.run(_burst(guard["url"], 4, max_tokens=8))
        assert [status for status, _, _ in answers] == [200] * 4, answers
        with urllib.request.urlopen(guard["url"] + "/status", timeout=5) as resp:
            backend = json.loads(resp.read())["backends"][0]
        assert backend["engine"] == "llama.cpp" and backend["kv_unified"] is False
        assert (backend["slots"], backend["n_ctx_per_slot"]) == (2, 256)
        assert run.terminate() == 0
        assert not run.engine_processes_left()


def test_guard_waits_while_llama_server_loads(
    llama_server_binary: Path,  # noqa: F811
    gguf: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    """The guard is up before llama-server: ``/health`` answers 503 while the model loads, the
    backend is not routed to (the guard is not ready), then it is, and requests pass."""
    from oomguard.engine import EngineProcess, http_ok
    from oomguard.tiering.command import llama_server_argv

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"backends": [url], "poll_interval_s": 0.05}))
    settings = LlamaCppSettings(ctx_size=SLOTS * CTX_PER_SLOT * 8, parallel=SLOTS)
    argv = llama_server_argv(
        str(gguf), settings, binary=str(llama_server_binary), host="127.0.0.1", port=port
    )
    errors: list[str] = []
    guard_port = free_port()
    guard = EngineProcess(
        [*oomguard_exe, "guard", "--config", str(config), "--port", str(guard_port)],
        log_path=tmp_path / "guard.log",
    )
    guard.start()
    process_url = f"http://127.0.0.1:{guard_port}"
    server = EngineProcess(argv, log_path=tmp_path / "llama.log")
    try:
        assert guard.wait_healthy(process_url + "/health", 60), guard.tail(20)
        for attempt in range(3):
            with urllib.request.urlopen(process_url + "/status", timeout=5) as resp:
                assert json.loads(resp.read())["backends"][0]["healthy"] is False
            assert not http_ok(process_url + "/ready", timeout_s=2.0)
            errors.clear()
            server.start()
            deadline = time.monotonic() + 90
            backend: dict[str, object] = {}
            while time.monotonic() < deadline:
                with urllib.request.urlopen(process_url + "/status", timeout=5) as resp:
                    backend = json.loads(resp.read())["backends"][0]
                if backend["healthy"]:
                    break
                errors.append(str(backend["last_error"]))
                time.sleep(0.01)
            assert backend["healthy"] and backend["engine"] == "llama.cpp", backend
            if any("503" in e and "loading" in e for e in errors):
                break
            # The tiny model loaded between two health polls (a loaded machine stretches
            # them): start it again so that the guard's poll meets the loading window.
            server.stop(grace_s=5.0)
            server = EngineProcess(argv, log_path=tmp_path / f"llama-{attempt + 1}.log")
            _wait_unhealthy(process_url, 30)
        assert any("503" in e and "loading" in e for e in errors), sorted(set(errors))
        answers = asyncio.run(_burst(process_url, 2, max_tokens=4))
        assert [status for status, _, _ in answers] == [200, 200], answers
    finally:
        server.stop(grace_s=5.0)
        guard.stop(grace_s=5.0)


def _wait_unhealthy(process_url: str, timeout_s: float) -> None:
    """Until the guard's /status shows its backend unhealthy (the server was stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(process_url + "/status", timeout=5) as resp:
            if not json.loads(resp.read())["backends"][0]["healthy"]:
                return
        time.sleep(0.05)
    raise AssertionError("the guard still shows the stopped llama-server healthy")
