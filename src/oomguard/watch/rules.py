"""The alerts ``oomguard watch`` raises, with their thresholds, in one table.

The watcher evaluates these rules itself, and ``deploy/generate.py`` writes the same rules as
Prometheus alerting rules (PromQL), so a threshold changed here changes both. Each rule has
a firing threshold, a lower level that clears it (hysteresis: a value hovering at the
threshold does not flap), a minimum duration before it fires, and a severity.

Why these defaults:

- KV usage 85 % / 90 %: the troubleshooting guide's 85 % alert level, and the 90 % at which
  the guard pauses admission (its low watermark, 80 %, is where the warning clears). vLLM is
  built to run its pool full, so these warn of pressure; preemptions are the harm.
- Preemptions in the last minute: each one throws away a sequence's KV and recomputes it.
- Requests waiting for capacity (vLLM 0.20+): admitted requests the scheduler could not start
  because the pool had no blocks.
- Free GPU memory below 1 GiB: vLLM already holds its budget; what is left is for the CUDA
  context's growth, NCCL, the sampler's transients and other tenants. Below that a transient
  allocation outside the pool fails.
- Memory above the plan: the engine's processes hold more than the plan's budget
  (``gpu_memory_utilization × total``) by more than 5 %: something outside vLLM's accounting
  grew (a leak, a co-tenant in the same process, a different configuration than planned).
- A leak: used memory that keeps growing after the pool is allocated (robust Theil-Sen slope
  of at least 10 MiB/min over 5 minutes, rising in every minute of it), with the time left.
- A server that stops answering its ``/metrics`` for 15 s.
- An engine that keeps dying: two deaths within 15 minutes (it stopped answering, or came back
  as a new process between two samples). A crash that repeats is seldom memory (an illegal
  instruction, a missing kernel image, a driver or NCCL failure): restarting does not fix it,
  and each restart reloads the model. ``oomguard serve`` stops one that dies twice at its
  first request; an orchestrator that restarts it again and again is what this catches.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.units import GIB, MIB


@dataclass(frozen=True)
class AlertRule:
    """One alert: fires when ``value`` crosses ``threshold`` for ``for_s`` seconds, and
    resolves once it is back past ``clear`` (``above``: high values are bad)."""

    name: str
    severity: str  # "warning" | "critical"
    threshold: float
    clear: float
    for_s: float
    summary: str
    unit: str  # how value and threshold read: "ratio", "count", "bytes", "bytes/s", "s"
    above: bool = True

    def breached(self, value: float) -> bool:
        """Whether ``value`` is past the firing threshold."""
        return value >= self.threshold if self.above else value < self.threshold

    def still_breached(self, value: float) -> bool:
        """Whether a firing alert stays firing at ``value`` (past the clearing level)."""
        return value >= self.clear if self.above else value < self.clear


KV_HIGH = AlertRule(
    "OomguardKvCacheHigh",
    "warning",
    0.85,
    0.80,
    60.0,
    "KV cache usage is high",
    "ratio",
)
KV_CRITICAL = AlertRule(
    "OomguardKvCacheCritical",
    "critical",
    0.90,
    0.85,
    30.0,
    "KV cache nearly full",
    "ratio",
)
PREEMPTIONS = AlertRule(
    "OomguardPreemptions",
    "warning",
    1.0,
    1.0,
    0.0,
    "vLLM preempted requests in the last minute",
    "count",
)
WAITING_FOR_CAPACITY = AlertRule(
    "OomguardWaitingForCapacity",
    "warning",
    1.0,
    1.0,
    30.0,
    "requests wait for KV capacity",
    "count",
)
GPU_FREE_LOW = AlertRule(
    "OomguardGpuFreeMemoryLow",
    "critical",
    1.0 * GIB,
    1.25 * GIB,
    30.0,
    "free GPU memory below the margin",
    "bytes",
    above=False,
)
MEMORY_ABOVE_PLAN = AlertRule(
    "OomguardMemoryAbovePlan",
    "critical",
    1.05,
    1.02,
    60.0,
    "engine memory above what the plan allows",
    "ratio",
)
MEMORY_LEAK = AlertRule(
    "OomguardMemoryLeak",
    "warning",
    10.0 * MIB / 60.0,
    5.0 * MIB / 60.0,
    120.0,
    "used memory keeps growing after the pool was allocated",
    "bytes/s",
)
SERVER_DOWN = AlertRule(
    "OomguardServerDown",
    "critical",
    1.0,
    1.0,
    15.0,
    "the server does not answer",
    "count",
)
ENGINE_DYING = AlertRule(
    "OomguardEngineKeepsDying",
    "critical",
    2.0,
    2.0,
    0.0,
    "the engine keeps dying",
    "count",
)
KV_POOL_BELOW_PLAN = AlertRule(
    "OomguardKvPoolBelowPlan",
    "warning",
    0.95,
    0.97,
    0.0,
    "the KV pool is smaller than the plan",
    "ratio",
    above=False,
)

RULES: tuple[AlertRule, ...] = (
    KV_HIGH, KV_CRITICAL, PREEMPTIONS, WAITING_FOR_CAPACITY, GPU_FREE_LOW, MEMORY_ABOVE_PLAN,
    MEMORY_LEAK, SERVER_DOWN, ENGINE_DYING, KV_POOL_BELOW_PLAN,
)  # fmt: skip
RULES_BY_NAME = {r.name: r for r in RULES}

PREEMPTION_WINDOW_S = 60.0  # "preemptions in the last minute"
DEATH_WINDOW_S = 900.0  # "deaths in the last 15 minutes"
LEAK_WINDOW_S = 300.0  # the span the slope is measured over
LEAK_SEGMENTS = 5  # the window's parts; used memory must rise (or hold) from each to the next
LEAK_SETTLE_S = 60.0  # after the pool is allocated (or watching starts), before measuring
LEAK_CRITICAL_TTE_S = 3600.0  # a leak that exhausts memory within this is critical
