"""The gateway's own Prometheus metrics, in a registry of its own.

Counters and histograms are updated inline (pre-bound label children, so the hot path does no
label lookups); gauges that mirror state (queue, reservations, backend feedback) are read at
scrape time by a collector.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from oomguard.guard.backends import BackendPool
    from oomguard.guard.openai_body import CharsPerTokenLearner
    from oomguard.guard.queue import AdmissionQueue, DrainRateMeter
    from oomguard.guard.shared import SharedAdmission

OUTCOMES = (
    "ok",
    "client_error",
    "never_fits",
    "shed_queue_full",
    "shed_queue_timeout",
    "upstream_client_error",
    "upstream_failed",
    "stream_error",
    "client_disconnected",
    "no_backend",
)

_LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
    1.0,
)
_WAIT_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _StateCollector(Collector):
    def __init__(
        self,
        pool: BackendPool,
        queue: AdmissionQueue,
        drain: DrainRateMeter,
        chars_per_token: CharsPerTokenLearner | None,
        shared: SharedAdmission | None = None,
    ) -> None:
        self.pool, self.queue, self.drain = pool, queue, drain
        self.chars_per_token = chars_per_token
        self.shared = shared

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())

    def _collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "oomguard_queue_depth_requests", "Requests waiting in the queue", value=self.queue.depth
        )
        yield GaugeMetricFamily(
            "oomguard_queue_tokens",
            "KV tokens the queued requests would need",
            value=self.queue.tokens,
        )
        yield GaugeMetricFamily(
            "oomguard_drain_rate_per_second",
            "Requests admitted per second over the last window",
            value=self.drain.rate_per_s(time.monotonic()),
        )
        if self.chars_per_token is not None:
            yield GaugeMetricFamily(
                "oomguard_estimate_chars_per_token",
                "Characters per token the prompt estimate uses (learned from exact counts)",
                value=self.chars_per_token.value,
            )
        if self.shared is not None:
            yield from self._shared_metrics(self.shared)
        now = time.monotonic()
        g = {
            name: GaugeMetricFamily(name, doc, labels=["backend"])
            for name, doc in (
                ("oomguard_backend_healthy", "1 when the backend is in routing"),
                ("oomguard_reserved_tokens", "KV tokens reserved by admitted requests"),
                ("oomguard_reserved_blocks", "KV blocks reserved by admitted requests"),
                ("oomguard_capacity_blocks", "Usable KV blocks (num_gpu_blocks - 1)"),
                (
                    "oomguard_projected_peak_blocks",
                    "Most KV blocks the requests in flight will hold at any future step",
                ),
                ("oomguard_tracked_requests", "Requests in flight whose progress is read"),
                (
                    "oomguard_decode_rate_tokens_per_second",
                    "Peak per-sequence decode rate seen recently (0 while unknown)",
                ),
                ("oomguard_external_kv_blocks", "KV blocks in use by traffic not seen here"),
                ("oomguard_effective_capacity_fraction", "Capacity fraction after tightening"),
                ("oomguard_admission_paused", "1 while admission is latched off (hysteresis)"),
                ("oomguard_backend_in_flight", "Requests the gateway has in flight there"),
                ("oomguard_backend_kv_cache_usage", "vllm:kv_cache_usage_perc as last polled"),
                ("oomguard_backend_requests_waiting", "vllm:num_requests_waiting as last polled"),
                ("oomguard_backend_requests_running", "vllm:num_requests_running as last polled"),
            )
        }
        pre = CounterMetricFamily(
            "oomguard_backend_preemptions_seen",
            "Preemptions observed on the backend",
            labels=["backend"],
        )
        pauses = CounterMetricFamily(
            "oomguard_admission_pauses", "Times admission latched off", labels=["backend"]
        )
        for b in self.pool.backends:
            a, m, lb = b.admission, b.metrics, [b.url]
            g["oomguard_backend_healthy"].add_metric(lb, 1.0 if b.healthy else 0.0)
            g["oomguard_reserved_tokens"].add_metric(lb, a.reserved_tokens)
            g["oomguard_reserved_blocks"].add_metric(lb, a.reserved_blocks)
            g["oomguard_capacity_blocks"].add_metric(lb, a.capacity_blocks or 0)
            g["oomguard_projected_peak_blocks"].add_metric(lb, a.projected_blocks(now))
            g["oomguard_tracked_requests"].add_metric(lb, a.tracked_requests)
            g["oomguard_decode_rate_tokens_per_second"].add_metric(lb, a.rate.tokens_per_s or 0.0)
            g["oomguard_external_kv_blocks"].add_metric(lb, a.external_blocks)
            g["oomguard_effective_capacity_fraction"].add_metric(lb, a.effective_fraction)
            g["oomguard_admission_paused"].add_metric(lb, 1.0 if a.paused else 0.0)
            g["oomguard_backend_in_flight"].add_metric(lb, b.in_flight)
            if m.kv_cache_usage is not None:
                g["oomguard_backend_kv_cache_usage"].add_metric(lb, m.kv_cache_usage)
            if m.requests_waiting is not None:
                g["oomguard_backend_requests_waiting"].add_metric(lb, m.requests_waiting)
            if m.requests_running is not None:
                g["oomguard_backend_requests_running"].add_metric(lb, m.requests_running)
            pre.add_metric(lb, a.preemptions_seen)
            pauses.add_metric(lb, a.pause_count)
        yield from g.values()
        yield pre
        yield pauses

    def _shared_metrics(self, shared: SharedAdmission) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "oomguard_shared_state_up",
            "1 while admission is shared through Redis, 0 while the static share applies",
            value=1.0 if shared.active else 0.0,
        )
        yield GaugeMetricFamily(
            "oomguard_replicas",
            "Guard replicas the fair share divides by (0 while unknown)",
            value=float(shared.replicas or 0),
        )
        yield CounterMetricFamily(
            "oomguard_shared_state_failures",
            "Redis calls that failed (admission then keeps to the static share)",
            value=shared.failures,
        )
        share = GaugeMetricFamily(
            "oomguard_static_share_blocks",
            "KV blocks this replica keeps per backend: it admits within them, Redis or not",
            labels=["backend"],
        )
        offered = GaugeMetricFamily(
            "oomguard_shared_offered_blocks",
            "KV blocks this replica offers to the others per backend (assumed taken while "
            "Redis is away)",
            labels=["backend"],
        )
        for b in self.pool.backends:
            budget = shared.budget(b.url)
            share.add_metric([b.url], float(budget.kept))
            offered.add_metric([b.url], float(budget.offered))
        yield share
        yield offered


class Telemetry:
    """All gateway metrics; ``registry`` is what ``/metrics`` renders."""

    def __init__(
        self,
        pool: BackendPool,
        queue: AdmissionQueue,
        drain: DrainRateMeter,
        chars_per_token: CharsPerTokenLearner | None = None,
        shared: SharedAdmission | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        requests = Counter(
            "oomguard_requests",
            "Generation requests by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.outcome = {o: requests.labels(o) for o in OUTCOMES}
        shed = Counter(
            "oomguard_shed",
            "Requests shed (429 queue full, 503 queue timeout)",
            ["reason"],
            registry=self.registry,
        )
        self.shed_full = shed.labels("queue_full")
        self.shed_timeout = shed.labels("queue_timeout")
        self.retries = Counter(
            "oomguard_retries",
            "Upstream attempts retried after a backend failure",
            registry=self.registry,
        )
        self.priority_ignored = Counter(
            "oomguard_priority_ignored",
            "Requests that asked for a priority their API key does not allow (served at 0)",
            registry=self.registry,
        )
        self.estimated_prompts = Counter(
            "oomguard_prompt_tokens_estimated",
            "Requests whose prompt length was estimated (no tokenizer reachable)",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "oomguard_queue_wait_seconds",
            "Time admitted requests spent queued",
            buckets=_WAIT_BUCKETS_S,
            registry=self.registry,
        )
        self.added_latency = Histogram(
            "oomguard_added_latency_seconds",
            "Time the gateway adds to a non-streamed request (excluding queue wait and upstream)",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(pool, queue, drain, chars_per_token, shared))
