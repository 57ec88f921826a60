"""The oomguard Grafana dashboard, built with grafana-foundation-sdk.

Rows: vLLM's KV cache (usage with the 85 % / 90 % watermarks, preemptions, requests waiting
for capacity), memory against the plan (GPU memory of the engine against the plan's budget,
free GPU memory against the margin, host memory, growth and time to exhaustion, the KV pool
against the plan), the guard (admissions by outcome, queue, shed, reservations against
capacity), and the alerts firing. Written to JSON by ``deploy/generate.py``.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders.common import (
    GraphThresholdsStyleConfig,
    ReduceDataOptions,
    VizLegendOptions,
    VizTooltipOptions,
)
from grafana_foundation_sdk.models.common import (
    BigValueGraphMode,
    GraphTresholdsStyleMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
    VisibilityMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
)

from oomguard.watch import rules as R

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
GIB = 2**30


def _query(expr: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return (
        prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)
    )


def _thresholds(*steps: tuple[float | None, str]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=v, color=c) for v, c in steps])
    )


def _series(
    title: str, unit: str, description: str, *queries: prometheus.Dataquery, width: int = 12
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(width)
        .legend(
            VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    )
    for q in queries:
        panel = panel.with_target(q)
    return panel


def _watermarked(panel: timeseries.Panel, *steps: tuple[float | None, str]) -> timeseries.Panel:
    """Draw the thresholds as dashed lines on the panel."""
    return panel.thresholds(_thresholds(*steps)).thresholds_style(
        GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.DASHED)
    )


def kv_row(d: dash.Dashboard) -> dash.Dashboard:
    """KV cache usage, preemptions, waiting for capacity."""
    usage = _watermarked(
        _series(
            "KV cache usage",
            "percentunit",
            f"vllm:kv_cache_usage_perc per engine. Dashed: the warning ({R.KV_HIGH.threshold:.0%}) "
            f"and critical ({R.KV_CRITICAL.threshold:.0%}) alert levels.",
            _query("vllm:kv_cache_usage_perc", "{{instance}} {{model_name}} engine {{engine}}"),
        )
        .min(0)
        .max(1),
        (None, "green"),
        (R.KV_HIGH.threshold, "orange"),
        (R.KV_CRITICAL.threshold, "red"),
    )
    preempt = _series(
        "Preemptions per minute",
        "short",
        "increase(vllm:num_preemptions_total[1m]): sequences whose KV was thrown "
        "away and recomputed.",
        _query(
            "sum by (instance, model_name) (increase(vllm:num_preemptions_total[1m]))",
            "{{instance}} {{model_name}}",
        ),
    )
    waiting = _series(
        "Requests running, waiting, waiting for capacity",
        "short",
        'vllm:num_requests_running / _waiting, and _waiting_by_reason{reason="capacity"} (vLLM '
        "0.20+).",
        _query("sum by (instance) (vllm:num_requests_running)", "{{instance}} running", "A"),
        _query("sum by (instance) (vllm:num_requests_waiting)", "{{instance}} waiting", "B"),
        _query(
            'sum by (instance) (vllm:num_requests_waiting_by_reason{reason="capacity"})',
            "{{instance}} waiting for capacity",
            "C",
        ),
    )
    return (
        d.with_row(dash.Row("vLLM KV cache"))
        .with_panel(usage)
        .with_panel(preempt)
        .with_panel(waiting.span(24))
    )


def memory_row(d: dash.Dashboard) -> dash.Dashboard:
    """GPU and host memory against the plan, growth and time to exhaustion."""
    gpu = _series(
        "GPU memory of the engine against the plan",
        "bytes",
        "oomguard_watch_engine_gpu_memory_bytes (per process from NVML, or the whole device where "
        "NVML cannot tell processes apart) beside the plan's budget "
        "(gpu_memory_utilization × total).",
        _query(
            "oomguard_watch_engine_gpu_memory_bytes", "{{server}} GPU {{gpu}} ({{source}})", "A"
        ),
        _query(
            'oomguard_watch_plan_gpu_memory_bytes{part="requested"}', "{{server}} plan budget", "B"
        ),
        _query('oomguard_watch_plan_gpu_memory_bytes{part="total"}', "{{server}} GPU total", "C"),
    )
    free = _watermarked(
        _series(
            "Free GPU memory",
            "bytes",
            "oomguard_watch_gpu_memory_free_bytes. Dashed: the "
            f"{R.GPU_FREE_LOW.threshold / GIB:g} GiB margin.",
            _query("oomguard_watch_gpu_memory_free_bytes", "{{server}} GPU {{gpu}} {{name}}"),
        ),
        (None, "red"),
        (R.GPU_FREE_LOW.threshold, "green"),
    )
    host = _series(
        "Host memory of the engine",
        "bytes",
        "oomguard_watch_engine_host_memory_bytes (RSS of its processes).",
        _query("oomguard_watch_engine_host_memory_bytes", "{{server}}"),
    )
    growth = _series(
        "Memory growth (robust slope) and time to exhaustion",
        "Bps",
        "oomguard_watch_memory_growth_bytes_per_second: the Theil-Sen slope of used memory over "
        "the leak window; time to exhaustion on the right axis.",
        _query(
            "oomguard_watch_memory_growth_bytes_per_second", "{{server}} {{memory}} growth", "A"
        ),
        _query(
            "oomguard_watch_memory_time_to_exhaustion_seconds / 3600",
            "{{server}} {{memory}} hours left",
            "B",
        ),
    )
    pool = _series(
        "KV pool against the plan",
        "short",
        "oomguard_watch_kv_cache_tokens (as the server states it) and the plan's prediction.",
        _query("oomguard_watch_kv_cache_tokens", "{{server}} live", "A"),
        _query("oomguard_watch_plan_kv_cache_tokens", "{{server}} plan", "B"),
    )
    return (
        d.with_row(dash.Row("Memory against the plan"))
        .with_panel(gpu)
        .with_panel(free)
        .with_panel(host)
        .with_panel(growth)
        .with_panel(pool.span(24))
    )


def guard_row(d: dash.Dashboard) -> dash.Dashboard:
    """The guard's admissions, queue, shedding and reservations."""
    admissions = _series(
        "Guard: requests by outcome",
        "reqps",
        "rate(oomguard_requests_total[1m]) by outcome.",
        _query("sum by (outcome) (rate(oomguard_requests_total[1m]))", "{{outcome}}"),
    )
    queue = _series(
        "Guard: queue and shed",
        "short",
        "oomguard_queue_depth_requests, and requests shed per minute (429 "
        "queue full, 503 timeout).",
        _query("sum by (instance) (oomguard_queue_depth_requests)", "{{instance}} queued", "A"),
        _query("sum by (reason) (increase(oomguard_shed_total[1m]))", "shed: {{reason}}", "B"),
    )
    blocks = _series(
        "Guard: reserved and projected KV blocks against capacity",
        "short",
        "oomguard_reserved_blocks and oomguard_projected_peak_blocks per backend, beside "
        "oomguard_capacity_blocks.",
        _query("oomguard_reserved_blocks", "{{backend}} reserved", "A"),
        _query("oomguard_projected_peak_blocks", "{{backend}} projected peak", "B"),
        _query("oomguard_capacity_blocks", "{{backend}} capacity", "C"),
    )
    paused = (
        stat.Panel()
        .title("Guard: admission paused")
        .datasource(DATASOURCE)
        .height(8)
        .span(6)
        .description(
            "oomguard_admission_paused: 1 while admission is latched off at the high watermark."
        )
        .with_target(_query("max by (backend) (oomguard_admission_paused)", "{{backend}}"))
        .thresholds(_thresholds((None, "green"), (1, "orange")))
        .graph_mode(BigValueGraphMode.AREA)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
    )
    return (
        d.with_row(dash.Row("Guard"))
        .with_panel(admissions)
        .with_panel(queue)
        .with_panel(blocks.span(18))
        .with_panel(paused)
    )


def alerts_row(d: dash.Dashboard) -> dash.Dashboard:
    """Which oomguard alerts fired, over time."""
    timeline = (
        statetimeline.Panel()
        .title("oomguard alerts firing")
        .datasource(DATASOURCE)
        .description(
            'ALERTS{alertname=~"Oomguard.*"} from Prometheus, and oomguard_watch_alert_firing from '
            "the watcher."
        )
        .height(8)
        .span(24)
        .show_value(VisibilityMode.NEVER)
        .merge_values(True)
        .with_target(
            _query(
                'max by (alertname, instance) (ALERTS{alertname=~"Oomguard.*", '
                'alertstate="firing"})',
                "{{alertname}} {{instance}}",
                "A",
            )
        )
        .with_target(
            _query(
                "max by (alertname, server) (oomguard_watch_alert_firing)",
                "watch: {{alertname}} {{server}}",
                "B",
            )
        )
    )
    return d.with_row(dash.Row("Alerts")).with_panel(timeline)


def build_dashboard() -> dash.Dashboard:
    """The whole dashboard."""
    d = (
        dash.Dashboard("oomguard: vLLM memory against the plan")
        .uid("oomguard-watch")
        .description(
            "vLLM KV cache, GPU memory against the plan, leaks, and the guard's admission."
        )
        .tags(["oomguard", "vllm"])
        .refresh("30s")
        .time("now-3h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for row in (kv_row, memory_row, guard_row, alerts_row):
        d = row(d)
    return d
