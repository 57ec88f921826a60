"""`oomguard guard` in front of real vLLM on CPU: the burst and the crash of issue 4.

vLLM serves the generated guard model (``scenarios.GUARD_SHAPE``) with a KV pool of 2,048
tokens (16 blocks of 128) and ``--max-model-len 1024``; 32 requests of 180 prompt tokens and ``max_tokens`` 300 arrive at
once. Directly, vLLM admits them all and preempts; through the guard, nothing is preempted and
everything completes. The throughput comparison is a figure, printed by
``bench/guard_burst.py``, not a timed assertion.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import scenarios
from burst import BurstResult, GuardProcess, make_prompts, run_burst
from tinymodel import TinyModel, create_tiny_model
from vllm_server import (
    ServeConfig,
    VllmServer,
    fetch_metrics,
    metric_value,
    running_vllm,
)

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


def test_guard_prevents_preemption_storm(
    guard_model: TinyModel, vllm_venv_path: Path, tmp_path: Path
) -> None:
    n = scenarios.GUARD_BURST_REQUESTS
    direct_prompts = make_prompts(guard_model.path, n, scenarios.GUARD_PROMPT_TOKENS, 0)
    guard_prompts = make_prompts(guard_model.path, n, scenarios.GUARD_PROMPT_TOKENS, n)
    model = str(guard_model.path)
    with running_vllm(_config(guard_model), tmp_path / "vllm.log") as server:
        assert "CPU KV cache size: 2,048 tokens" in server.log_text()
        direct = run_burst(
            "direct",
            server.base_url,
            server.base_url,
            model,
            direct_prompts,
            scenarios.GUARD_MAX_TOKENS,
        )
        with GuardProcess([server.base_url], tmp_path / "guard.log") as guard:
            guarded = run_burst(
                "through guard",
                guard.url,
                server.base_url,
                model,
                guard_prompts,
                scenarios.GUARD_MAX_TOKENS,
            )
    summary = f"direct={direct.summary()} guard={guarded.summary()}"
    assert direct.preemptions > 0, f"the direct burst did not preempt: {summary}"
    assert guarded.preemptions == 0, summary
    assert guarded.succeeded == n, summary
    assert guarded.throughput_tokens_per_s > 0, summary


def test_guard_survives_backend_crash(
    guard_model: TinyModel, vllm_venv_path: Path, tmp_path: Path
) -> None:
    n = scenarios.GUARD_BURST_REQUESTS
    prompts = make_prompts(guard_model.path, n, scenarios.GUARD_PROMPT_TOKENS, 2 * n)
    first = VllmServer(_config(guard_model), tmp_path / "vllm-1.log")
    first.start()
    second: VllmServer | None = None
    try:
        first.wait_healthy()
        port = first.port
        with GuardProcess(
            [first.base_url], tmp_path / "guard.log", ["--queue-timeout", "300"]
        ) as guard:
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
            second = VllmServer(
                ServeConfig(**{**_config(guard_model).__dict__, "port": port}),
                tmp_path / "vllm-2.log",
            )
            second.start()
            second.wait_healthy()
            sender.join(timeout=600)
            assert not sender.is_alive(), "burst did not finish within 600 s of the restart"
            assert guard.alive(), "the guard died"
        burst = outcome["burst"]
        assert burst.succeeded == n, burst.summary()
    finally:
        first.stop()
        if second is not None:
            second.stop()
