"""`oomguard guard` in front of real vLLM on CPU: bursts, a crash with a slow restart, replicas
on Redis, and the Responses / Messages routes.

vLLM serves the generated guard model (``scenarios.GUARD_SHAPE``) with a KV pool of 2,048
tokens (16 blocks of 128) and ``--max-model-len 1024``; 32 requests of 180 prompt tokens and
``max_tokens`` 300 arrive at once. Directly, vLLM admits them all and preempts; through the
guard (one, or three replicas sharing admission through a real redis-server), nothing is
preempted and everything completes. Throughput comparisons are figures printed by
``bench/guard_burst.py``, not timed assertions. One vLLM server serves every test but the
crash test, which kills its own.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import scenarios
from burst import (
    MIXES,
    BurstResult,
    GuardProcess,
    make_prompts,
    make_shaped_prompts,
    run_burst,
    run_shaped_burst,
)
from redis_server import RedisServer
from tinymodel import TinyModel, create_tiny_model
from vllm_server import (
    ServeConfig,
    VllmServer,
    fetch_metrics,
    metric_value,
    running_vllm,
)

from oomguard.engine import signal_group
from oomguard.guard.shared import backend_keys

QUEUE_600 = ["--queue-timeout", "600"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def guard_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The generated model of the guard scenario (config + tokenizer, dummy weights)."""
    shape = scenarios.GUARD_SHAPE
    return create_tiny_model(tmp_path_factory.mktemp("models") / shape.name, shape)


def _config(model: TinyModel) -> ServeConfig:
    return ServeConfig(
        model_dir=model.path,
        kv_cache_memory_bytes=scenarios.guard_kv_bytes(model.shape),
        max_model_len=scenarios.GUARD_MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def vllm(
    guard_model: TinyModel, vllm_venv_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One vLLM server of the guard scenario, shared by the tests that do not kill it."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with running_vllm(_config(guard_model), log) as server:
        yield server


def test_guard_prevents_preemption_storm(
    guard_model: TinyModel, vllm: VllmServer, tmp_path: Path
) -> None:
    n = scenarios.GUARD_BURST_REQUESTS
    direct_prompts = make_prompts(guard_model.path, n, scenarios.GUARD_PROMPT_TOKENS, 0)
    guard_prompts = make_prompts(guard_model.path, n, scenarios.GUARD_PROMPT_TOKENS, n)
    model = str(guard_model.path)
    assert "CPU KV cache size: 2,048 tokens" in vllm.log_text()
    direct = run_burst(
        "direct", vllm.base_url, vllm.base_url, model, direct_prompts, scenarios.GUARD_MAX_TOKENS
    )
    # A long queue timeout: on a loaded 2-core machine draining the queue may take minutes,
    # and this test is about preemptions and completions, not about shedding.
    with GuardProcess([vllm.base_url], tmp_path / "guard.log", QUEUE_600) as guard:
        guarded = run_burst(
            "through guard",
            guard.url,
            vllm.base_url,
            model,
            guard_prompts,
            scenarios.GUARD_MAX_TOKENS,
        )
    summary = f"direct={direct.summary()} guard={guarded.summary()}"
    assert direct.preemptions > 0, f"the direct burst did not preempt: {summary}"
    assert guarded.preemptions == 0, summary
    assert guarded.succeeded == n, summary
    assert guarded.throughput_tokens_per_s > 0, summary


def _status(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url + "/status", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def _wait(what: str, cond: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _admissions(logs: Path) -> str:
    """The replicas' admission logs and warnings (what a preemption is traced back with)."""
    out = []
    for log in sorted(logs.glob("g*.log")):
        lines = [ln for ln in log.read_text().splitlines() if "admitted" in ln or "WARNING" in ln]
        out.append(f"{log.name}:\n" + "\n".join(lines[-40:]))
    return "\n".join(out)


def _mode(guard: GuardProcess) -> str:
    shared = _status(guard.url)["shared_state"]
    assert isinstance(shared, dict)
    return str(shared["mode"])


def test_three_replicas_on_redis_share_one_backend(
    guard_model: TinyModel, vllm: VllmServer, tmp_path: Path
) -> None:
    """The burst spread over three replicas; Redis killed mid-burst and back; a replica
    SIGKILLed while its requests run: its leases come back within their expiry."""
    redis_server = RedisServer(tmp_path / "redis").start()
    config = tmp_path / "guard.yaml"
    lease_s = 3.0
    config.write_text(f"lease_s: {lease_s}\nqueue_timeout_s: 600\nlog_admissions: true\n")
    args = ["--redis-url", redis_server.url, "--config", str(config)]
    model = str(guard_model.path)
    shapes = MIXES["uniform"]()
    try:
        with (
            GuardProcess([vllm.base_url], tmp_path / "g1.log", args) as g1,
            GuardProcess([vllm.base_url], tmp_path / "g2.log", args) as g2,
            GuardProcess([vllm.base_url], tmp_path / "g3.log", args) as g3,
        ):
            replicas = [g1, g2, g3]
            urls = [g.url for g in replicas]
            _wait("three replicas sharing", lambda: all(_mode(g) == "shared" for g in replicas))
            prompts = make_shaped_prompts(guard_model.path, shapes, 10_000)
            spread = run_shaped_burst("3 replicas", urls, vllm.base_url, model, prompts, shapes)
            assert spread.preemptions == 0, (spread.summary(), _admissions(tmp_path))
            assert spread.succeeded == len(shapes), spread.summary()

            # Redis killed mid-burst: static shares, nothing preempted or lost; back again.
            prompts = make_shaped_prompts(guard_model.path, shapes, 20_000)
            outcome: dict[str, BurstResult] = {}
            sender = threading.Thread(
                target=lambda: outcome.update(
                    b=run_shaped_burst("redis killed", urls, vllm.base_url, model, prompts, shapes)
                )
            )
            sender.start()
            _wait(
                "requests running in vLLM",
                lambda: (
                    metric_value(fetch_metrics(vllm.base_url), "vllm:num_requests_running") >= 1
                ),
            )
            # vLLM's preemption counter at each stage, to tell them apart if one shows up.
            counts: dict[str, float] = {}

            def count(stage: str) -> None:
                metrics = fetch_metrics(vllm.base_url)
                counts[stage] = metric_value(metrics, "vllm:num_preemptions_total")

            count("before kill")
            redis_server.kill()
            _wait("the static share", lambda: all(_mode(g) == "static_share" for g in replicas))
            time.sleep(3.0)
            count("before restart")
            redis_server.start()
            _wait("sharing again", lambda: all(_mode(g) == "shared" for g in replicas))
            count("sharing again")
            sender.join(timeout=600)
            assert not sender.is_alive(), "the burst did not finish"
            count("end")
            outage = outcome["b"]
            assert outage.preemptions == 0, (outage.summary(), counts, _admissions(tmp_path))
            assert outage.succeeded == len(shapes), outage.summary()

            # A replica SIGKILLed while its requests hold leases.
            shared = _status(g3.url)["shared_state"]
            assert isinstance(shared, dict)
            dead_id = str(shared["replica_id"])
            keys = backend_keys("oomguard", vllm.base_url)
            client = redis.Redis.from_url(redis_server.url)
            few = shapes[:6]
            prompts = make_shaped_prompts(guard_model.path, few, 30_000)
            sender = threading.Thread(
                target=lambda: run_shaped_burst("killed", [g3.url], None, model, prompts, few),
                daemon=True,
            )
            sender.start()

            def dead_entry() -> str | None:
                raw = client.hget(keys.members, dead_id)
                return None if raw is None else raw.decode()

            def dead_holds() -> bool:
                entry = dead_entry()  # kept|offered|want|want_ms|seen|holding|…
                return entry is not None and int(entry.split("|")[5]) >= 1

            _wait("requests held by the replica", dead_holds)
            assert g3.proc is not None
            signal_group(g3.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            _wait("its entry reclaimed", lambda: dead_entry() is None, timeout_s=lease_s + 10)
            reclaimed_s = time.monotonic() - killed_at
            assert reclaimed_s <= lease_s + 2.0, reclaimed_s
            sender.join(timeout=60)

            # What it kept comes back once vLLM's usage shows its requests gone: the two
            # survivors serve a burst again, nothing preempted.
            prompts = make_shaped_prompts(guard_model.path, few, 40_000)
            after = run_shaped_burst("survivors", urls[:2], vllm.base_url, model, prompts, few)
            assert after.preemptions == 0, after.summary()
            assert after.succeeded == len(few), after.summary()
    finally:
        redis_server.stop()


def test_responses_and_messages_stream_through_the_guard(
    guard_model: TinyModel, vllm: VllmServer, tmp_path: Path
) -> None:
    model = str(guard_model.path)
    with GuardProcess([vllm.base_url], tmp_path / "guard.log") as guard:
        for path, body, last in (
            (
                "/v1/responses",
                {"model": model, "input": "a b c", "max_output_tokens": 24, "stream": True},
                b"response.completed",
            ),
            (
                "/v1/messages",
                {
                    "model": model,
                    "max_tokens": 24,
                    "stream": True,
                    "messages": [{"role": "user", "content": "a b c"}],
                },
                b"message_stop",
            ),
        ):
            req = urllib.request.Request(
                guard.url + path,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            chunks = []
            with urllib.request.urlopen(req, timeout=120) as resp:
                assert resp.status == 200
                assert resp.headers["x-oomguard-progress"] == "reserved"
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
            data = b"".join(chunks)
            assert last in data, data[-500:]
            assert len(chunks) > 1  # relayed as it came, not whole at the end
            assert b'"error"' not in data


def test_guard_survives_backend_crash_with_a_slow_restart(
    guard_model: TinyModel, vllm_venv_path: Path, tmp_path: Path
) -> None:
    """vLLM is SIGKILLed mid-burst and comes back only after 125 s (longer than the fixed
    120 s the guard used to wait): every accepted request still completes, with the guard's
    default restart wait."""
    n = scenarios.GUARD_BURST_REQUESTS
    prompts = make_prompts(guard_model.path, n, scenarios.GUARD_PROMPT_TOKENS, 2 * n)
    first = VllmServer(_config(guard_model), tmp_path / "vllm-1.log")
    first.start()
    second: VllmServer | None = None
    try:
        first.wait_healthy()
        port = first.port
        # The restart wait is the guard's default; only the queue timeout is long (see above).
        with GuardProcess([first.base_url], tmp_path / "guard.log", QUEUE_600) as guard:
            outcome: dict[str, BurstResult] = {}

            def send() -> None:
                outcome["burst"] = run_burst(
                    "through guard, backend killed",
                    guard.url,
                    None,  # vLLM restarts mid-burst: its preemption counter restarts too
                    str(guard_model.path),
                    prompts,
                    scenarios.GUARD_MAX_TOKENS,
                    stream=False,
                )

            sender = threading.Thread(target=send)
            sender.start()
            # Kill vLLM while requests are running in it.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                running = metric_value(fetch_metrics(first.base_url), "vllm:num_requests_running")
                if running >= 1:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("no request reached vLLM within 60 s")
            first.crash()
            killed_at = time.monotonic()
            time.sleep(max(125.0 - (time.monotonic() - killed_at), 0.0))
            second = VllmServer(
                ServeConfig(**{**_config(guard_model).__dict__, "port": port}),
                tmp_path / "vllm-2.log",
            )
            second.start()
            second.wait_healthy()
            sender.join(timeout=600)
            assert not sender.is_alive(), "burst did not finish within 600 s of the restart"
            assert guard.alive(), "the guard died"
            backend = _status(guard.url)["backends"]
            assert isinstance(backend, list)
            assert backend[0]["longest_restart_s"] >= 125.0
        burst = outcome["burst"]
        assert burst.succeeded == n, burst.summary()
    finally:
        first.stop()
        if second is not None:
            second.stop()
