"""The admission log (``log_admissions``): one line per admitted request, naming the rule that
admitted it, so that a preemption can be traced back to the admission that allowed it."""

from __future__ import annotations

import asyncio

import pytest

from oomguard.guard.admission import RequestCost

from .test_pump_cadence import make_gate


def test_the_admission_log_names_the_rule_that_admitted_each_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> list[str]:
        gate = make_gate()
        gate.log_admissions = True
        small = RequestCost(100, 100, trackable=True)
        with caplog.at_level("INFO", logger="oomguard.guard"):
            first = await gate.acquire(small, None, 0, 1.0)
            second = await gate.acquire(small, None, 0, 1.0)
        gate.release(first)
        gate.release(second)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("admitted")]

    lines = asyncio.run(run())
    assert len(lines) == 2
    # nothing in flight: the idle rule; then the full reservations fit under the watermark
    assert " by idle:" in lines[0] and " by plain:" in lines[1]
    assert "100 prompt + 100 planned of 100 max_tokens × 1 on http://b" in lines[1]
    assert "2 blocks reserved" in lines[0] and "4 blocks reserved" in lines[1]


def test_no_admission_log_by_default(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        gate = make_gate()
        with caplog.at_level("INFO", logger="oomguard.guard"):
            gate.release(await gate.acquire(RequestCost(100, 100, trackable=True), None, 0, 1.0))

    asyncio.run(run())
    assert not [r for r in caplog.records if r.getMessage().startswith("admitted")]
