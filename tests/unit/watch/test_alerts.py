"""Alert states: minimum duration, hysteresis, resolved events, what a round covers."""

from __future__ import annotations

from oomguard.watch import rules as R
from oomguard.watch.alerts import AlertTracker, observe


def _run(
    values: list[float], rule: R.AlertRule = R.KV_HIGH, **kw: float
) -> list[tuple[float, str]]:
    tracker = AlertTracker(**kw)  # type: ignore[arg-type]
    out = []
    for t, v in enumerate(values):
        for e in tracker.update(float(t * 10), [observe(rule, "s", v, "m")]):
            out.append((e.at_s, e.state))
    return out


def test_fires_only_after_the_minimum_duration() -> None:
    # 60 s at >= 85 %: pending at 0..50 s, firing at 60 s
    assert _run([0.9] * 7) == [(60.0, "firing")]
    assert _run([0.9] * 6) == []


def test_a_dip_while_pending_restarts_the_clock() -> None:
    assert _run([0.9] * 5 + [0.5] + [0.9] * 6) == []


def test_hysteresis_holds_between_the_levels_and_resolves_below() -> None:
    events = _run([0.9] * 7 + [0.82] * 10 + [0.79])
    assert events == [(60.0, "firing"), (170.0, "resolved")]


def test_min_duration_overrides_every_rule() -> None:
    assert _run([0.9], min_duration_s=0.0) == [(0.0, "firing")]


def test_below_threshold_rules() -> None:
    free = [2e9, 0.9e9, 0.9e9, 0.9e9, 0.9e9, 1.1e9, 1.4e9]
    assert _run(free, R.GPU_FREE_LOW) == [(40.0, "firing"), (60.0, "resolved")]


def test_event_fields_and_json_form() -> None:
    tracker = AlertTracker(min_duration_s=0)
    e = tracker.update(
        1_700_000_000.0, [observe(R.KV_CRITICAL, "http://a:8000", 0.95, "msg", gpu="0")]
    )[0]
    d = e.to_dict()
    assert set(d) >= {
        "event",
        "alert",
        "severity",
        "state",
        "value",
        "threshold",
        "server",
        "since",
        "message",
    }
    assert (d["event"], d["alert"], d["severity"], d["state"]) == (
        "alert",
        "OomguardKvCacheCritical",
        "critical",
        "firing",
    )
    assert d["value"] == 0.95 and d["threshold"] == 0.9 and d["labels"] == {"gpu": "0"}
    assert d["since"] == "2023-11-14T22:13:20.000Z"


def test_instances_not_observed_on_a_covered_server_resolve() -> None:
    tracker = AlertTracker(min_duration_s=0)
    tracker.update(0.0, [observe(R.GPU_FREE_LOW, "host", 1e8, "m", gpu="1")], {"host"})
    events = tracker.update(1.0, [], {"host"})
    assert [e.state for e in events] == ["resolved"]
    tracker.update(2.0, [observe(R.KV_HIGH, "down", 0.99, "m")], {"down"})
    assert tracker.update(3.0, [], set()) == []  # a server not covered keeps its alerts
    assert len(tracker.firing()) == 1
