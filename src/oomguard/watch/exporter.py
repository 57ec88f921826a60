"""The watcher's own ``/metrics``: what it sees, the plan's figures beside it, and its alerts.

Every series is labelled with the ``server`` it belongs to (the vLLM base URL, or
``pid:N``), so a dashboard can draw each server's memory against its plan. GPU series that
belong to the host carry ``gpu`` (and the host's name in ``server``). Values are read at
scrape time from the watcher's latest round (a collector), so scraping costs the loop nothing.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from oomguard.watch.runner import Watch

PREFIX = "oomguard_watch_"

# name → help; every name here is exported, and checked by the tests against the rules
GAUGES: dict[str, str] = {
    "up": "1 when the server answered its last /metrics scrape (or the process is alive)",
    "kv_cache_usage_ratio": "vllm:kv_cache_usage_perc of the fullest engine (0-1)",
    "kv_cache_tokens": "The KV pool of one engine in tokens, as the server states it",
    "plan_kv_cache_tokens": "The KV pool in tokens the plan predicted",
    "plan_gpu_memory_bytes": (
        "The plan's per-GPU figures (part: requested, weights, kv_cache, total)"
    ),
    "recent_preemptions": "Preemptions counted over the preemption window (a minute by default)",
    "requests_running": "vllm:num_requests_running",
    "requests_waiting": "vllm:num_requests_waiting",
    "requests_waiting_for_capacity": "vllm:num_requests_waiting_by_reason{reason=capacity}",
    "gpu_memory_total_bytes": "GPU memory total (NVML)",
    "gpu_memory_used_bytes": "GPU memory used by every process together (NVML)",
    "gpu_memory_free_bytes": "GPU memory free (NVML)",
    "engine_gpu_memory_bytes": (
        "GPU memory of the server's processes (source: nvml-process, or nvml-device = whole device)"
    ),
    "engine_host_memory_bytes": "Resident host memory of the server's processes",
    "memory_growth_bytes_per_second": (
        "Robust (Theil-Sen) slope of used memory over the leak window"
    ),
    "memory_time_to_exhaustion_seconds": "Time until the memory runs out at the current growth",
    "alert_firing": "1 for each alert firing now",
    "scrape_duration_seconds": "How long the last /metrics scrape took",
}
COUNTERS: dict[str, str] = {
    "scrape_errors": "Scrapes that failed (no answer, HTTP error)",
    "alert_events": "Alert events emitted (state: firing, resolved)",
}


def metric_names() -> list[str]:
    """Every series name the exporter writes (counters with their ``_total``)."""
    return [PREFIX + n for n in GAUGES] + [PREFIX + n + "_total" for n in COUNTERS]


class _WatchCollector(Collector):
    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.host = socket.gethostname()

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())

    def _collect(self) -> Iterator[Metric]:
        labels = {
            "plan_gpu_memory_bytes": ["server", "part"],
            "gpu_memory_total_bytes": ["server", "gpu", "name"],
            "gpu_memory_used_bytes": ["server", "gpu", "name"],
            "gpu_memory_free_bytes": ["server", "gpu", "name"],
            "engine_gpu_memory_bytes": ["server", "gpu", "source"],
            "memory_growth_bytes_per_second": ["server", "memory"],
            "memory_time_to_exhaustion_seconds": ["server", "memory"],
            "alert_firing": ["alertname", "severity", "server", "detail"],
        }
        g = {
            n: GaugeMetricFamily(PREFIX + n, doc, labels=labels.get(n, ["server"]))
            for n, doc in GAUGES.items()
        }
        c = {
            n: CounterMetricFamily(
                PREFIX + n, doc, labels=["server"] if n == "scrape_errors" else ["state"]
            )
            for n, doc in COUNTERS.items()
        }
        w = self.watch
        for name, state in w.evaluator.states.items():
            s = state.sample
            plan = state.plan
            if plan is not None:
                g["plan_kv_cache_tokens"].add_metric([name], plan.kv_cache_tokens)
                for part, value in (
                    ("requested", plan.requested_bytes),
                    ("weights", plan.weights_bytes),
                    ("kv_cache", plan.kv_cache_bytes),
                    ("total", plan.gpu_total_bytes),
                ):
                    g["plan_gpu_memory_bytes"].add_metric([name, part], value)
            c["scrape_errors"].add_metric([name], w.scrape_errors.get(name, 0))
            if s is None:
                continue
            g["up"].add_metric([name], 1.0 if s.up else 0.0)
            g["scrape_duration_seconds"].add_metric([name], s.scrape_s)
            snap = s.snapshot
            if snap is not None:
                for key, reading in (
                    ("kv_cache_usage_ratio", snap.kv_cache_usage),
                    ("kv_cache_tokens", snap.kv_cache_tokens),
                    ("requests_running", snap.requests_running),
                    ("requests_waiting", snap.requests_waiting),
                    ("requests_waiting_for_capacity", snap.waiting_for_capacity),
                    ("recent_preemptions", state.recent_preemptions),
                ):
                    if reading is not None:
                        g[key].add_metric([name], float(reading))
            if s.host_rss_bytes is not None:
                g["engine_host_memory_bytes"].add_metric([name], s.host_rss_bytes)
            for share in s.gpus:
                g["engine_gpu_memory_bytes"].add_metric(
                    [name, str(share.index), s.gpu_source], share.used_bytes
                )
            for series, v in state.leaks.items():
                if v.ready:
                    g["memory_growth_bytes_per_second"].add_metric(
                        [name, series], v.slope_bytes_per_s
                    )
                    if v.time_to_exhaustion_s is not None:
                        g["memory_time_to_exhaustion_seconds"].add_metric(
                            [name, series], v.time_to_exhaustion_s
                        )
        for d in w.devices or ():
            lb = [self.host, str(d.index), d.name]
            g["gpu_memory_total_bytes"].add_metric(lb, d.total_bytes)
            g["gpu_memory_used_bytes"].add_metric(lb, d.used_bytes)
            g["gpu_memory_free_bytes"].add_metric(lb, d.free_bytes)
        for obs in w.tracker.firing():
            detail = ",".join(f"{k}={v}" for k, v in sorted(obs.labels.items()))
            g["alert_firing"].add_metric(
                [obs.rule.name, obs.severity or obs.rule.severity, obs.server, detail], 1.0
            )
        for state_name in ("firing", "resolved"):
            c["alert_events"].add_metric([state_name], w.event_counts.get(state_name, 0))
        yield from g.values()
        yield from c.values()


def make_registry(watch: Watch) -> CollectorRegistry:
    """A registry whose only collector reads ``watch``'s latest round."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WatchCollector(watch))
    return registry
