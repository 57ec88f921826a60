"""How often a waiting queue is retried: once per engine step, not once per streamed chunk.

Every retry runs the admission over the queue, and that CPU is taken from an engine on the
same host (vLLM on CPU shares it with the guard). The projection cannot change faster than a
sequence gains tokens, one per engine step, so retries follow the backend's decode rate.
"""

from __future__ import annotations

import asyncio

import pytest

from oomguard.guard import gate as gate_module
from oomguard.guard.admission import AdmissionSettings, RequestCost
from oomguard.guard.backends import BackendPool
from oomguard.guard.config import GuardConfig
from oomguard.guard.gate import Gate
from oomguard.guard.queue import AdmissionQueue, DrainRateMeter


def make_gate() -> Gate:
    config = GuardConfig(backends=[{"url": "http://b"}], track_progress="always")
    pool = BackendPool(config, AdmissionSettings(track_mode="always"), on_change=lambda: None)
    backend = pool.backends[0]
    backend.healthy = True
    backend.admission.set_capacity(12, 128)
    return Gate(
        pool,
        AdmissionQueue(16, 10**9),
        DrainRateMeter(),
        retry_fallback_s=1.0,
        max_retry_after_s=10,
    )


def _count_pumps(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    times: list[float] = []
    pump = gate.pump

    def counted() -> None:
        times.append(gate_module.time.monotonic())
        pump()

    monkeypatch.setattr(gate, "pump", counted)
    return times


@pytest.mark.parametrize(
    ("tokens_per_s", "expected_s"),
    [
        (None, gate_module.WAITING_PUMP_INTERVAL_S),  # no rate yet: the fastest cadence
        (25.0, 0.04),  # one step of a sequence decoding 25 tokens/s
        (2000.0, gate_module.WAITING_PUMP_INTERVAL_S),  # never faster than the floor
        (5.0, gate_module.MAX_PUMP_INTERVAL_S),  # never slower than the cap
    ],
)
def test_a_waiting_queue_is_retried_once_per_engine_step(
    tokens_per_s: float | None, expected_s: float
) -> None:
    gate = make_gate()
    rate = gate.pool.backends[0].admission.rate
    for _ in range(8):
        if tokens_per_s is not None:
            rate.observe_rate(tokens_per_s)
    assert gate._step_s(gate_module.WAITING_PUMP_INTERVAL_S) == pytest.approx(expected_s)


def test_progress_of_every_chunk_does_not_retry_the_queue_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def run() -> tuple[int, int]:
        gate = make_gate()
        rate = gate.pool.backends[0].admission.rate
        for _ in range(8):
            rate.observe_rate(25.0)  # an engine step of 40 ms
        big = RequestCost(800, 300, trackable=True)  # 9 of the 11 usable blocks
        held = await gate.acquire(big, None, 0, 5.0)
        waiting = asyncio.ensure_future(gate.acquire(big, None, 0, 5.0))
        await asyncio.sleep(0)
        assert gate.queue.depth == 1
        times = _count_pumps(gate, monkeypatch)
        # 100 chunks over 0.2 s (five engine steps): progress, but nothing finishes
        clock = [gate_module.time.monotonic()]
        monkeypatch.setattr(gate_module.time, "monotonic", lambda: clock[0])
        for k in range(100):
            clock[0] += 0.002
            gate.note_progress(held, 0, k + 1, False)
        progress_pumps = len(times)
        # the end of a sequence retries at once
        gate.note_progress(held, 0, 101, True)
        finished_pumps = len(times) - progress_pumps
        gate.release(held)
        waiting.cancel()
        return progress_pumps, finished_pumps

    progress_pumps, finished_pumps = asyncio.run(run())
    assert 4 <= progress_pumps <= 6  # about one per 40 ms step, not 100
    assert finished_pumps == 1
