"""Leak detection on recorded traces of real processes, replayed at full speed, and on the
shapes that must not count as a leak."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from oomguard.watch import rules as R
from oomguard.watch.alerts import AlertEvent, AlertTracker, Observation
from oomguard.watch.leak import LeakDetector, replay, theil_sen_slope

DATA = Path(__file__).parent / "data"
MIB = 2**20
GIB = 2**30


def load_trace(name: str) -> tuple[dict[str, object], list[tuple[float, float]]]:
    lines = (DATA / name).read_text().splitlines()
    header = json.loads(lines[0])
    return header, [(float(t), float(v)) for t, v in (json.loads(line) for line in lines[1:])]


def leak_events(
    samples: list[tuple[float, float]], available_bytes: float = 8 * GIB
) -> list[AlertEvent]:
    """The leak alert's events over a trace, as the watcher raises them (with its for_s)."""
    tracker = AlertTracker()
    events = []
    for t, v in replay(samples, available_bytes):
        if v.ready:
            obs = Observation(
                R.MEMORY_LEAK,
                "trace",
                v.slope_bytes_per_s,
                v.suspected,
                v.slope_bytes_per_s >= R.MEMORY_LEAK.clear,
                "",
            )
            events.extend(tracker.update(t, [obs]))
    return events


def test_theil_sen_is_exact_on_a_line_and_ignores_outliers() -> None:
    t = np.arange(30.0)
    assert theil_sen_slope(t, 3.0 * t + 7) == pytest.approx(3.0)
    spiky = 3.0 * t + 7
    spiky[[4, 11, 20]] += 1e9  # three wild samples move the median slope by nothing
    assert theil_sen_slope(t, spiky) == pytest.approx(3.0)


def test_a_real_process_growing_50_mib_per_min_is_flagged_within_10_minutes() -> None:
    header, samples = load_trace("trace_grow_50mib_per_min.jsonl")
    assert header["rate_mib_per_min"] == 50.0 and samples[-1][0] >= 890
    events = leak_events(samples)
    firing = [e for e in events if e.state == "firing"]
    assert firing, "the leak was not flagged"
    assert firing[0].at_s <= 600.0
    assert firing[0].value * 60 / MIB == pytest.approx(50.0, rel=0.15)


def test_time_to_exhaustion_counts_down_from_what_is_left() -> None:
    _, samples = load_trace("trace_grow_50mib_per_min.jsonl")
    t, verdict = replay(samples, available_bytes=2 * GIB)[-1]
    used = samples[-1][1] - samples[0][1]
    expected_s = (2 * GIB - used) / verdict.slope_bytes_per_s
    assert verdict.suspected
    assert verdict.time_to_exhaustion_s == pytest.approx(expected_s, rel=1e-6)
    assert 10 * 60 < verdict.time_to_exhaustion_s < 40 * 60  # ~1.25 GiB left at ~50 MiB/min


def test_a_step_is_not_a_leak() -> None:
    """A warm-up allocation of 300 MiB once, then flat, with noise: nothing fires."""
    rng = np.random.default_rng(0)
    samples = [
        (float(t), 4 * GIB + (300 * MIB if t > 400 else 0) + rng.normal(0, 5 * MIB))
        for t in range(3600)
    ]
    assert leak_events(samples) == []


def test_slow_drift_below_the_rate_is_not_a_leak() -> None:
    samples = [(float(t), 4 * GIB + t * (4 * MIB / 60)) for t in range(3600)]
    assert leak_events(samples) == []


def test_the_leak_resolves_when_growth_stops() -> None:
    samples = [(float(t), 2 * GIB + min(t, 900) * (40 * MIB / 60)) for t in range(2400)]
    states = [e.state for e in leak_events(samples)]
    assert states == ["firing", "resolved"]


def test_a_restart_forgets_the_old_baseline() -> None:
    det = LeakDetector(window_s=60, settle_s=0)
    for t in range(120):
        det.add(float(t), 1e9 + t * 1e6)
    assert det.verdict().suspected
    det.reset()
    for t in range(120, 150):
        det.add(float(t), 1e8)
    assert not det.verdict().ready


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        LeakDetector(window_s=0)


def test_real_vllm_warming_up_under_traffic_raises_one_warning_that_resolves() -> None:
    """The first hour of real vLLM (CPU) under random traffic, scored once as it arrived.

    Its host memory grows 530 MiB as traffic warms it up: ~30 MiB/min for the first 13
    minutes, ~10 MiB/min until 30 minutes, ~3 MiB/min until 45, then flat. Over a 5-minute
    window that first stretch cannot be told from a leak, and the watcher warns (at 7.9 min,
    30+ MiB/min, hours from exhaustion); the warning resolves once the growth slows (16 min),
    and nothing fires again over the remaining 45 minutes although memory still creeps up by
    150 MiB. ``--leak-settle`` longer than the warm-up silences the first warning.
    """
    header, samples = load_trace("trace_flat_vllm_1h.jsonl")
    assert header["trace"] == "flat-vllm" and samples[-1][0] >= 3600
    events = leak_events(samples)
    assert [e.state for e in events] == ["firing", "resolved"]
    assert events[0].severity == "warning" and events[1].at_s < 20 * 60
    settled = [(t, v) for t, v in samples if t >= 20 * 60]
    assert leak_events(settled) == []


def test_a_flat_hour_of_warmed_up_vllm_raises_nothing() -> None:
    """An hour of real vLLM (CPU) under random traffic after a 5-minute warm-up over every
    batch size and length: its host memory moves within 16 MiB, with the noise of real
    bursts. Scored once as it arrived: no leak alert (robust slope -0.0 to +1.3 MiB/min)."""
    header, samples = load_trace("trace_flat_vllm_warmed_1h.jsonl")
    assert header["trace"] == "flat-vllm-warmed" and samples[-1][0] >= 3600
    assert leak_events(samples) == []
