"""The prefix-cache hit rate: read from vLLM's counters, stored by bench and watch, and the
seeds' step 6 (prefix caching off below 30 % hits) applied by plan and the lint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from rich.console import Console

from oomguard.bench.calibrate import record_run
from oomguard.bench.report import print_summary, result_dict
from oomguard.bench.runner import BenchResult, BenchSettings
from oomguard.bench.server import ServerInfo
from oomguard.bench.workload import FixedWorkload
from oomguard.calibration import StartupMeasurement, Store, catalogue_gpu_name
from oomguard.calibration.prefix import (
    MIN_REQUESTS,
    OFF_FLAG,
    ON_FLAG,
    PrefixCacheWindow,
    advise,
    measured_advice,
    window_between,
    window_fields,
)
from oomguard.doctor.lint import lint_command
from oomguard.plan import plan
from oomguard.vllm_metrics import VllmSnapshot, parse_vllm_metrics
from oomguard.watch.prefix import PrefixCacheRecorder, RecordKey
from oomguard.watch.sampling import TargetSample

PAGE = Path(__file__).parents[2] / "integration" / "data" / "metrics_vllm_0.32.0_after_burst.txt"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
T0 = 1_790_000_000.0  # a Unix time


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OOMGUARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def snap(queries: float | None, hits: float | None, finished: float | None) -> VllmSnapshot:
    return VllmSnapshot(
        prefix_cache_queries_total=queries,
        prefix_cache_hits_total=hits,
        requests_succeeded_total=finished,
    )


def window(
    queries: int, hits: int, requests: int | None, since: str = "2026-11-28T20:00:00+00:00"
) -> PrefixCacheWindow:
    return PrefixCacheWindow(queries, hits, requests, 120.0, since)


def store_window(
    w: PrefixCacheWindow,
    *,
    gpu: str = "H100",
    version: str = "0.32.0",
    source: str = "bench http://127.0.0.1:8000",
    tp: int = 1,
    recorded_at: str = "2026-11-28T20:02:00+00:00",
) -> None:
    Store().add(
        [
            StartupMeasurement(
                gpu=catalogue_gpu_name(gpu),
                vllm_version=version,
                model=LLAMA,
                family="llama-3.1-8b",
                tp=tp,
                source=source,
                recorded_at=recorded_at,
                **window_fields(w),
            )
        ]
    )


# --- reading the counters --------------------------------------------------------------------


def test_the_real_page_carries_the_counters_and_the_served_name() -> None:
    s = parse_vllm_metrics(PAGE.read_text())
    # 12 distinct prompts of 180 tokens looked up, none found: vLLM 0.32 counts tokens
    assert s.prefix_cache_queries_total == 12 * 180
    assert s.prefix_cache_hits_total == 0.0
    assert s.model_name == "tiny-llama"


def test_counters_are_summed_over_engines() -> None:
    page = "\n".join(
        [
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0',
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 150.0',
        ]
    )
    s = parse_vllm_metrics(page)
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (1500.0, 750.0)


def test_a_window_is_the_counters_difference() -> None:
    w = window_between(snap(1000, 100, 10), snap(5000, 2500, 40), T0, T0 + 90)
    assert w is not None
    assert (w.queries, w.hits, w.requests, w.window_s) == (4000, 2400, 30, 90.0)
    assert w.hit_rate == 0.6 and w.basis
    assert w.started_at == "2026-09-21T14:13:20+00:00"


def test_no_window_without_counters_or_across_a_restart() -> None:
    assert window_between(snap(None, None, 5), snap(10, 5, 6), T0, T0 + 1) is None
    assert window_between(snap(5000, 100, 40), snap(100, 0, 1), T0, T0 + 1) is None  # restarted
    w = window_between(snap(0, 0, None), snap(100, 50, None), T0, T0 + 1)
    assert w is not None and w.requests is None and not w.basis  # requests not counted


# --- the rule --------------------------------------------------------------------------------


def test_the_rule_of_step_6() -> None:
    on = advise(window(10_000, 6_400, 40), source="bench x")
    assert on.enable is True and on.flag == ON_FLAG
    assert "64% of 10,000 prompt tokens (40 requests" in on.reason
    assert "throughput" in on.reason and "pool holds more" in on.reason
    off = advise(window(10_000, 1_000, 40), source="watch y")
    assert off.enable is False and off.flag == OFF_FLAG
    assert (
        "below the checklist's 30% line (step 6)" in off.reason
        and "measured by watch y" in off.reason
    )
    assert advise(window(10_000, 3_000, 40), source="b").enable is True  # 30 % is on the line
    assert "within 5% of the line" in advise(window(10_000, 2_800, 40), source="b").reason


def test_too_few_requests_are_no_basis() -> None:
    few = advise(window(10_000, 9_000, MIN_REQUESTS - 1), source="bench x")
    assert few.enable is None and few.flag is None
    assert f"at least {MIN_REQUESTS} finished requests" in few.reason


# --- the store -------------------------------------------------------------------------------


def test_store_round_trip_and_key(home: Path) -> None:
    assert measured_advice("H100", None, LLAMA) is None  # nothing measured: nothing said
    store_window(window(8_000, 4_000, 25), gpu="NVIDIA H100 80GB HBM3")
    row = json.loads((home / "calibration.json").read_text())["entries"][
        "h100 sxm|0.32|llama-3.1-8b|tp1"
    ][0]
    assert (row["prefix_cache_queries"], row["prefix_cache_hits"]) == (8_000, 4_000)
    assert (row["prefix_cache_requests"], row["prefix_cache_window_s"]) == (25, 120.0)
    assert row["prefix_cache_since"] == "2026-11-28T20:00:00+00:00"
    found = measured_advice("H100", None, "meta-llama/Llama-3.1-8B")  # any version, same family
    assert found is not None and found.window == window(8_000, 4_000, 25)
    assert found.key == "h100 sxm|0.32|llama-3.1-8b|tp1" and found.source.startswith("bench")
    assert measured_advice("H100", "0.32.1", LLAMA) is not None  # the same minor
    assert measured_advice("H100", "0.30", LLAMA) is None
    assert measured_advice("A100 80GB", None, LLAMA) is None
    assert measured_advice("H100", None, LLAMA, tp=2) is None


def test_newest_basis_wins_over_a_newer_thin_window(home: Path) -> None:
    store_window(window(9_000, 900, 50, "2026-11-28T09:00"), recorded_at="2026-11-28T10:00")
    store_window(window(300, 280, 3, "2026-11-28T10:30"), recorded_at="2026-11-28T11:00")
    found = measured_advice("H100", None, LLAMA)
    assert found is not None and found.enable is False and found.window.requests == 50
    store_window(window(9_000, 8_000, 60, "2026-11-28T11:30"), recorded_at="2026-11-28T12:00")
    newest = measured_advice("H100", None, LLAMA)
    assert newest is not None and newest.enable is True


def test_a_growing_window_replaces_its_earlier_row(home: Path) -> None:
    store_window(window(100, 50, 2), source="watch http://a")
    store_window(window(9_000, 4_500, 90), source="watch http://a")  # same start: one row
    store_window(window(1_000, 500, 30), source="watch http://b")
    rows = Store().rows("h100 sxm|0.32|llama-3.1-8b|tp1")
    assert sorted((r.source, r.prefix_cache_requests) for r in rows) == [
        ("watch http://a", 90),
        ("watch http://b", 30),
    ]


# --- bench and watch record it ---------------------------------------------------------------


def _bench_result(w: PrefixCacheWindow | None) -> BenchResult:
    info = ServerInfo(
        url="http://127.0.0.1:8000",
        model=LLAMA,
        models=[LLAMA],
        max_model_len=4096,
        vllm_version="0.32.0",
        metrics_source="vllm",
        metrics_url="http://127.0.0.1:8000/metrics",
        capacity=None,
        local=False,
        tokenize_url=None,
    )
    settings = BenchSettings(url=info.url, workload=FixedWorkload(1000, 10, 600))
    return BenchResult(settings=settings, server=info, prefix_cache=w)


def test_bench_stores_the_rate_without_a_safe_point(home: Path) -> None:
    stored = record_run(_bench_result(window(24_000, 14_000, 24)), gpu="H100")
    assert stored["stored"] is True and stored["prefix_cache"]["hit_rate"] == 0.5833
    found = measured_advice("H100", None, LLAMA)
    assert found is not None and found.enable is True
    assert found.source.startswith("bench http://127.0.0.1:8000")
    nothing = record_run(_bench_result(None), gpu="H100")
    assert nothing["stored"] is False and "no prefix-cache lookups" in nothing["why"]


def test_bench_summary_says_the_rate_and_the_flag() -> None:
    data = result_dict(_bench_result(window(24_000, 14_000, 24)))
    assert data["prefix_cache"]["flag"] == ON_FLAG and data["prefix_cache"]["requests"] == 24
    console = Console(record=True, width=300)
    print_summary(data, console)
    assert f"prefix cache: {ON_FLAG}: measured by bench http://127.0.0.1:8000: 58%" in (
        console.export_text()
    )
    assert result_dict(_bench_result(None))["prefix_cache"] is None


def test_watch_records_each_server_window_and_restarts_it(home: Path) -> None:
    rec = PrefixCacheRecorder(RecordKey(gpu="H100", vllm_version="0.32.0"), {})

    def sample(name: str, s: VllmSnapshot) -> TargetSample:
        return TargetSample(name=name, at_s=0.0, up=True, snapshot=s)

    named = {"model_name": LLAMA}
    rec.observe([sample("http://a", VllmSnapshot(**named, **_counts(1000, 0, 0)))], T0)
    rec.observe([sample("http://a", VllmSnapshot(**named, **_counts(9000, 6000, 30)))], T0 + 60)
    rows = asyncio.run(rec.record(None, None, set()))  # type: ignore[arg-type]
    assert rows[0]["stored"] and rows[0]["queries"] == 8000 and rows[0]["requests"] == 30
    found = measured_advice("H100", None, LLAMA)
    assert found is not None and found.enable is True and found.source == "watch http://a"
    rec.observe([sample("http://a", VllmSnapshot(**named, **_counts(50, 0, 1)))], T0 + 120)
    restarted = rec.window("http://a")  # the counters went back: a new window from there
    assert restarted is not None and (restarted.queries, restarted.window_s) == (0, 0.0)


def test_watch_without_a_gpu_says_what_is_missing(home: Path) -> None:
    rec = PrefixCacheRecorder(RecordKey(vllm_version="0.32.0"), {})
    s = VllmSnapshot(model_name=LLAMA, **_counts(0, 0, 0))
    rec.observe([TargetSample(name="http://a", at_s=0.0, up=True, snapshot=s)], T0)
    later = VllmSnapshot(model_name=LLAMA, **_counts(500, 100, 25))
    rec.observe([TargetSample(name="http://a", at_s=0.0, up=True, snapshot=later)], T0 + 5)
    (row,) = asyncio.run(rec.record(None, None, set()))  # type: ignore[arg-type]
    assert row["stored"] is False and "pass --gpu" in row["why"]


def _counts(queries: float, hits: float, finished: float) -> dict[str, float]:
    return {
        "prefix_cache_queries_total": queries,
        "prefix_cache_hits_total": hits,
        "requests_succeeded_total": finished,
    }


# --- plan and the lint say it ----------------------------------------------------------------


def test_plan_recommends_from_the_measurement_and_says_nothing_without(home: Path) -> None:
    assert plan(LLAMA, "H100", allow_hub=False).prefix_caching is None
    store_window(window(20_000, 12_000, 40))
    result = plan(LLAMA, "H100", allow_hub=False)
    advice = result.prefix_caching
    assert advice is not None and advice.enable is True and advice.flag == ON_FLAG
    assert result.to_dict()["prefix_caching"]["measured"]["hit_rate"] == 0.6
    console = Console(record=True, width=400)
    from oomguard.plan.render import render

    render(result, console)
    text = console.export_text()
    assert f"Prefix caching: {ON_FLAG} (measured by bench http://127.0.0.1:8000: 60%" in text
    off = plan(LLAMA, "H100", allow_hub=False, enable_prefix_caching=False)
    assert "The command below sets the opposite" in _rendered(off)
    assert plan(LLAMA, "H100", allow_hub=False, use_calibration=False).prefix_caching is None


def _rendered(result: object) -> str:
    from oomguard.plan.render import render

    console = Console(record=True, width=400)
    render(result, console)  # type: ignore[arg-type]
    return console.export_text()


def test_lint_turns_it_off_on_a_low_measured_rate(home: Path) -> None:
    command = f"vllm serve {LLAMA}"
    before = lint_command(command, gpu="H100")
    assert not [f for f in before.findings if f.cause.startswith("prefix_caching")]
    store_window(window(20_000, 2_000, 40))
    report = lint_command(command, gpu="H100")
    (finding,) = [f for f in report.findings if f.cause == "prefix_caching_unused"]
    assert finding.summary == (
        "prefix caching is left on (vLLM's default) but its measured hit rate is 10%"
    )
    assert finding.fixes[0].flag == OFF_FLAG and "measured by bench" in finding.fixes[0].why
    agreed = lint_command(command + " --no-enable-prefix-caching", gpu="H100")
    assert not [f for f in agreed.findings if f.cause.startswith("prefix_caching")]
    assert any(n.startswith("prefix caching: measured by bench") for n in agreed.notes)


def test_lint_turns_it_on_on_a_high_measured_rate(home: Path) -> None:
    store_window(window(20_000, 15_000, 40))
    report = lint_command(f"vllm serve {LLAMA} --no-enable-prefix-caching", gpu="H100")
    (finding,) = [f for f in report.findings if f.cause == "prefix_caching_off"]
    assert finding.fixes[0].flag == ON_FLAG and finding.severity == "tip"
    # the measurement outranks the guess: on, with no shared prefix declared, is no tip
    on = lint_command(f"vllm serve {LLAMA} --enable-prefix-caching", gpu="H100")
    assert not [f for f in on.findings if f.cause.startswith("prefix_caching")]
