"""From samples to observations: vLLM's page (a real recorded one), NVML figures, the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.engine.memory import DeviceMemory
from oomguard.vllm_metrics import parse_vllm_metrics
from oomguard.watch import rules as R
from oomguard.watch.alerts import AlertTracker
from oomguard.watch.evaluate import Evaluator
from oomguard.watch.plan_figures import PlanFigures
from oomguard.watch.sampling import GpuShare, TargetSample, gpu_shares, watched_lines

PAGE = (
    Path(__file__).parents[2] / "integration" / "data" / "metrics_vllm_0.32.0_after_burst.txt"
).read_text()
GIB = 2**30
URL = "http://127.0.0.1:8000"


def page(usage: float = 0.0, preemptions: float = 1.0, capacity: float = 0.0) -> str:
    return (
        PAGE.replace(
            'kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0',
            f'kv_cache_usage_perc{{engine="0",model_name="tiny-llama"}} {usage}',
        )
        .replace(
            'num_preemptions_total{engine="0",model_name="tiny-llama"} 1.0',
            f'num_preemptions_total{{engine="0",model_name="tiny-llama"}} {preemptions}',
        )
        .replace('reason="capacity"} 0.0', f'reason="capacity"}} {capacity}')
    )


def sample(at_s: float, text: str | None = None, **kw: object) -> TargetSample:
    snap = parse_vllm_metrics(text or page())
    return TargetSample(name=URL, at_s=at_s, up=True, snapshot=snap, **kw)  # type: ignore[arg-type]


PLAN = PlanFigures(
    source="t",
    model="m",
    gpu_name="H100",
    gpu_count=1,
    gpu_total_bytes=80 * GIB,
    requested_bytes=72 * GIB,
    weights_bytes=16 * GIB,
    kv_cache_bytes=50 * GIB,
    kv_cache_tokens=2048,
    gpu_memory_utilization=0.9,
    max_num_seqs=None,
    max_model_len=None,
)


def by_name(observations: list) -> dict[str, list]:  # type: ignore[type-arg]
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for o in observations:
        out.setdefault(o.rule.name, []).append(o)
    return out


def test_the_watchers_line_filter_reads_the_same_figures() -> None:
    full, kept = parse_vllm_metrics(PAGE), parse_vllm_metrics(watched_lines(PAGE))
    for field in (
        "kv_cache_usage",
        "preemptions_total",
        "requests_running",
        "requests_waiting",
        "waiting_by_reason",
        "num_gpu_blocks",
        "block_size",
        "engines",
        "sleeping",
    ):
        assert getattr(full, field) == getattr(kept, field), field
    assert kept.kv_cache_tokens == 2048
    assert len(watched_lines(PAGE).splitlines()) < len(PAGE.splitlines()) / 5


def test_kv_waiting_and_pool_against_the_plan() -> None:
    ev = Evaluator({URL: PLAN})
    obs = by_name(ev.round([sample(0.0, page(usage=0.93, capacity=3))], None))
    assert [o.breached for o in obs["OomguardKvCacheHigh"]] == [True]
    assert [o.breached for o in obs["OomguardKvCacheCritical"]] == [True]
    assert (
        obs["OomguardWaitingForCapacity"][0].value == 3
        and obs["OomguardWaitingForCapacity"][0].breached
    )
    pool = obs["OomguardKvPoolBelowPlan"][0]
    assert pool.value == 1.0 and not pool.breached  # 2,048 tokens as planned


def test_a_smaller_pool_than_planned() -> None:
    plan = PlanFigures(**{**PLAN.__dict__, "kv_cache_tokens": 4096})
    obs = by_name(Evaluator({URL: plan}).round([sample(0.0)], None))
    assert (
        obs["OomguardKvPoolBelowPlan"][0].breached
        and obs["OomguardKvPoolBelowPlan"][0].value == 0.5
    )


def test_preemptions_are_counted_over_the_last_minute_and_survive_a_restart() -> None:
    ev = Evaluator({URL: None})
    counts = []
    for t, total in ((0, 1), (10, 1), (20, 4), (30, 9), (75, 9), (95, 9), (100, 2)):
        obs = by_name(ev.round([sample(float(t), page(preemptions=total))], None))
        counts.append(obs["OomguardPreemptions"][0].value)
    # 20 s: +3; 30 s: +8; 75 s: the minute 15..75 s is counted from the last sample at or before
    # its start (10 s: 1), so nothing inside it is missed -> 8; 95 s: 0; 100 s: counter restarted
    assert counts == [0, 0, 3, 8, 8, 0, 0]


def test_free_gpu_memory_and_memory_above_the_plan() -> None:
    devices = [DeviceMemory(0, "H100", 80 * GIB, 79 * GIB + GIB // 2, GIB // 2, {4242: 77 * GIB})]
    shares, source, note = gpu_shares((4242,), devices, single_local_target=True)
    assert source == "nvml-process" and shares[0].used_bytes == 77 * GIB and note == ""
    s = sample(0.0, gpus=shares, gpu_source=source)
    obs = by_name(Evaluator({URL: PLAN}).round([s], devices))
    assert obs["OomguardGpuFreeMemoryLow"][0].breached
    above = obs["OomguardMemoryAbovePlan"][0]
    assert above.value == pytest.approx(77 / 72) and above.breached and above.labels == {"gpu": "0"}


def test_nvml_without_our_pids_falls_back_to_whole_devices_and_says_so() -> None:
    devices = [
        DeviceMemory(0, "H100", 80 * GIB, 70 * GIB, 10 * GIB, {999: 70 * GIB}),
        DeviceMemory(1, "H100", 80 * GIB, 1 * GIB, 79 * GIB, {}),
    ]
    shares, source, note = gpu_shares((4242, 4243), devices, single_local_target=True)
    assert source == "nvml-device" and [g.used_bytes for g in shares] == [70 * GIB, 1 * GIB]
    assert "host PIDs" in note and "whole-device" in note
    shares, source, note = gpu_shares((4242,), devices, single_local_target=False)
    assert shares == () and source == "none" and "several targets" in note
    assert gpu_shares((4242,), None, True) == ((), "none", "")


def test_a_server_down_is_observed_and_its_other_alerts_kept() -> None:
    ev = Evaluator({URL: None})
    tracker = AlertTracker(min_duration_s=0)
    tracker.update(0.0, ev.round([sample(0.0, page(usage=0.95))], None), {URL})
    down = TargetSample(name=URL, at_s=1.0, up=False, error="cannot connect")
    obs = ev.round([down], None)
    assert [o.rule.name for o in obs] == ["OomguardServerDown"] and obs[0].breached
    events = tracker.update(1.0, obs, set())
    assert [(e.alert, e.state) for e in events] == [("OomguardServerDown", "firing")]
    assert {o.rule.name for o in tracker.firing()} >= {
        "OomguardKvCacheCritical",
        "OomguardServerDown",
    }


def test_leaks_are_measured_only_once_the_pool_exists() -> None:
    from oomguard.watch.evaluate import LeakSettings

    ev = Evaluator({URL: None}, LeakSettings(window_s=60, settle_s=0, min_rate_bytes_per_s=1e6))
    no_pool = parse_vllm_metrics(PAGE.replace('num_gpu_blocks="16"', 'num_gpu_blocks="None"'))
    for t in range(100):
        ev.round(
            [
                TargetSample(
                    name=URL,
                    at_s=float(t),
                    up=True,
                    snapshot=no_pool,
                    pids=(1,),
                    host_rss_bytes=10**9 + t * 10**7,
                )
            ],
            None,
        )
    assert URL not in [n for n, s in ev.states.items() if s.leaks]
    obs = []
    for t in range(100, 200):
        obs = ev.round([sample(float(t), pids=(1,), host_rss_bytes=10**9 + t * 10**7)], None)
    leak = by_name(obs)["OomguardMemoryLeak"][0]
    assert leak.breached and leak.labels == {"memory": "host"}
    assert leak.rule.threshold == 1e6 and "MiB/min" in leak.message


def test_gpu_share_type() -> None:
    assert GpuShare(0, 1, 2, 1).free_bytes == 1
    assert R.RULES_BY_NAME["OomguardMemoryLeak"] is R.MEMORY_LEAK


def test_an_engine_that_keeps_dying() -> None:
    """Two deaths in 15 minutes fire: it stopped answering, then came back as a new process
    (a later start time) between two samples; the alert resolves once they leave the window."""
    ev = Evaluator({URL: None})
    tracker = AlertTracker(min_duration_s=0)
    restarted = page().replace(
        "process_start_time_seconds 1.79562942229e+09",
        "process_start_time_seconds 1.79562992229e+09",
    )
    rounds = [
        (0.0, sample(0.0)),
        (10.0, TargetSample(name=URL, at_s=10.0, up=False, error="cannot connect")),
        (20.0, sample(20.0)),  # back: the death was counted when it went down
        (30.0, sample(30.0, restarted)),  # a new process although both samples saw it up
    ]
    counts, events = [], []
    for at, s in rounds:
        obs = [o for o in ev.round([s], None) if o.rule is R.ENGINE_DYING]
        counts.append([o.value for o in obs])
        events += tracker.update(at, obs, {URL} if s.up else set())
    assert counts == [[0.0], [], [1.0], [2.0]]
    assert [(e.alert, e.state, e.value) for e in events] == [
        ("OomguardEngineKeepsDying", "firing", 2.0)
    ]
    assert "died 2 time(s) in the last 15 min" in events[0].message
    later = ev.round([sample(30.0 + R.DEATH_WINDOW_S, restarted)], None)
    dying = [o for o in later if o.rule is R.ENGINE_DYING]
    assert dying[0].value == 0.0
    resolved = tracker.update(30.0 + R.DEATH_WINDOW_S, dying, {URL})
    assert [(e.alert, e.state) for e in resolved] == [("OomguardEngineKeepsDying", "resolved")]


def test_an_engine_dying_while_down_fires_without_waiting_for_it_to_answer() -> None:
    ev = Evaluator({URL: None})
    down = [TargetSample(name=URL, at_s=t, up=False, error="refused") for t in (10.0, 30.0)]
    ev.round([sample(0.0)], None)
    assert [o.rule.name for o in ev.round([down[0]], None)] == ["OomguardServerDown"]
    ev.round([sample(20.0)], None)
    obs = by_name(ev.round([down[1]], None))
    assert obs["OomguardEngineKeepsDying"][0].breached and obs["OomguardServerDown"][0].breached
