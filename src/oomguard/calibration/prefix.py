"""The prefix-cache hit rate a server measured, and whether to keep prefix caching on.

vLLM counts, for every new request it admits while prefix caching is on, the prompt tokens it
looked up in the prefix cache and how many of them it found there
(``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, :mod:`oomguard.vllm_metrics`).
``oomguard bench`` and ``oomguard watch`` read both counters at the start and at the end of a
window and store the difference, with the requests finished meanwhile, the window's length and
when it began, in the calibration store under its usual key (GPU, vLLM version, model family,
TP, PP).

The rule is the seeds' checklist, step 6 ("Use prefix caching only when it pays"): "measure
first … If it is below 30 per cent, turn prefix caching off". A rate stands only on enough
traffic: fewer than :data:`MIN_REQUESTS` finished requests, or none counted, is reported as
measured and set aside, never turned into advice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

from oomguard.calibration.store import (
    StartupMeasurement,
    Store,
    model_family,
    rows_for,
)

if TYPE_CHECKING:  # plan reads the store without the metrics parser (prometheus_client)
    from oomguard.vllm_metrics import VllmSnapshot

# the seeds' step 6: prefix caching off below about 30 % hits
HIT_RATE_LINE: Final = 0.30
# a rate this close to the line is said to be close (more traffic may tip it)
NEAR_LINE: Final = 0.05
# the fewest finished requests a rate is taken from
MIN_REQUESTS: Final = 20

ON_FLAG: Final = "--enable-prefix-caching"
OFF_FLAG: Final = "--no-enable-prefix-caching"


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class PrefixCacheWindow:
    """What the counters moved by over one window of a server's traffic."""

    queries: int  # prompt tokens looked up in the prefix cache
    hits: int  # of them, tokens served from cached blocks
    requests: int | None  # requests that finished in the window (None: not counted)
    window_s: float
    started_at: str  # ISO 8601, UTC

    @property
    def hit_rate(self) -> float | None:
        """Hits ÷ queries (None when nothing was looked up)."""
        return self.hits / self.queries if self.queries > 0 else None

    @property
    def basis(self) -> bool:
        """Whether the window is enough traffic to decide on."""
        return self.hit_rate is not None and (self.requests or 0) >= MIN_REQUESTS

    def to_dict(self) -> dict[str, Any]:
        rate = self.hit_rate
        return {
            "queries": self.queries,
            "hits": self.hits,
            "hit_rate": None if rate is None else round(rate, 4),
            "requests": self.requests,
            "window_s": round(self.window_s, 1),
            "started_at": self.started_at,
        }

    def describe(self) -> str:
        """``42 % of 9,600 prompt tokens (24 requests, 31 s from 2026-…)``."""
        rate = self.hit_rate
        share = (
            "no prompt tokens" if rate is None else f"{rate:.0%} of {self.queries:,} prompt tokens"
        )
        requests = "requests not counted" if self.requests is None else f"{self.requests} requests"
        return f"{share} ({requests}, {self.window_s:.0f} s from {self.started_at})"


def window_between(
    before: VllmSnapshot, after: VllmSnapshot, started_s: float, ended_s: float
) -> PrefixCacheWindow | None:
    """The window between two scrapes (Unix times given), or None when either page lacks the
    counters or they went back (the server restarted in between)."""
    q0, q1 = before.prefix_cache_queries_total, after.prefix_cache_queries_total
    h0, h1 = before.prefix_cache_hits_total, after.prefix_cache_hits_total
    if q0 is None or q1 is None or h0 is None or h1 is None or q1 < q0 or h1 < h0:
        return None
    r0, r1 = before.requests_succeeded_total, after.requests_succeeded_total
    requests = None if r0 is None or r1 is None or r1 < r0 else int(r1 - r0)
    return PrefixCacheWindow(
        queries=int(q1 - q0),
        hits=int(h1 - h0),
        requests=requests,
        window_s=max(0.0, ended_s - started_s),
        started_at=_iso(started_s),
    )


def window_fields(window: PrefixCacheWindow | None) -> dict[str, Any]:
    """The :class:`StartupMeasurement` fields that store ``window``."""
    if window is None:
        return {}
    return {
        "prefix_cache_queries": window.queries,
        "prefix_cache_hits": window.hits,
        "prefix_cache_requests": window.requests,
        "prefix_cache_window_s": round(window.window_s, 1),
        "prefix_cache_since": window.started_at,
    }


def window_of(obs: StartupMeasurement) -> PrefixCacheWindow | None:
    """The window an observation stored (None when it measured no hit rate)."""
    if obs.prefix_cache_queries is None or obs.prefix_cache_hits is None:
        return None
    return PrefixCacheWindow(
        queries=int(obs.prefix_cache_queries),
        hits=int(obs.prefix_cache_hits),
        requests=obs.prefix_cache_requests,
        window_s=float(obs.prefix_cache_window_s or 0.0),
        started_at=obs.prefix_cache_since or obs.recorded_at,
    )


@dataclass(frozen=True)
class PrefixCacheAdvice:
    """Prefix caching on or off, from a measured hit rate (``enable`` None: not a basis)."""

    window: PrefixCacheWindow
    source: str  # where it was measured (``bench http://…``, ``watch http://…``)
    key: str
    recorded_at: str
    enable: bool | None
    flag: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "enable": self.enable,
            "flag": self.flag,
            "reason": self.reason,
            "measured": self.window.to_dict(),
            "source": self.source,
            "key": self.key,
            "recorded_at": self.recorded_at,
        }


def advise(
    window: PrefixCacheWindow, *, source: str, key: str = "", recorded_at: str = ""
) -> PrefixCacheAdvice:
    """The seeds' rule applied to one measured window."""
    measured = f"measured by {source}: {window.describe()}"
    rate = window.hit_rate
    if rate is None or not window.basis:
        why = (
            f"{measured}; too little traffic to decide (at least {MIN_REQUESTS} finished "
            "requests are needed): measure over more requests"
        )
        return PrefixCacheAdvice(window, source, key, recorded_at, None, None, why)
    near = (
        f"; it is within {NEAR_LINE:.0%} of the line, so more traffic may tip it"
        if abs(rate - HIT_RATE_LINE) < NEAR_LINE
        else ""
    )
    if rate >= HIT_RATE_LINE:
        why = (
            f"{measured}, at or above the checklist's {HIT_RATE_LINE:.0%} line (step 6): that "
            "share of prefill is not recomputed (throughput, time to first token), and requests "
            "sharing a prefix hold its KV blocks once, so the same pool holds more of them"
        )
        return PrefixCacheAdvice(window, source, key, recorded_at, True, ON_FLAG, why + near)
    why = (
        f"{measured}, below the checklist's {HIT_RATE_LINE:.0%} line (step 6): the cache saves "
        "little prefill for the hashing and lookups every request pays, and on hybrid (Mamba) "
        "models it keeps extra state pages per request that the live KV cache could use"
    )
    return PrefixCacheAdvice(window, source, key, recorded_at, False, OFF_FLAG, why + near)


def measured_advice(
    gpu: str,
    vllm_version: str | None,
    model: str,
    tp: int = 1,
    pp: int = 1,
    *,
    store: Store | None = None,
) -> PrefixCacheAdvice | None:
    """Advice from the newest hit rate stored for the key, or None when none was measured.

    ``vllm_version`` None matches any version (a hit rate is the traffic's, not the
    release's). The newest window that is a basis wins; without one, the newest window is
    reported as not a basis.
    """
    store = store or Store()
    if not store.path.exists():
        return None
    family = model_family(model)
    versions = {key.split("|")[1] for key in store.load() if key.count("|") >= 3}
    if vllm_version is not None:
        versions = {vllm_version}
    rows: list[StartupMeasurement] = []
    for version in sorted(versions):
        rows.extend(rows_for(store, gpu, version, family, tp, pp))
    rows.sort(key=lambda o: o.recorded_at, reverse=True)
    measured = [(obs, w) for obs in rows if (w := window_of(obs)) is not None and w.queries > 0]
    if not measured:
        return None
    obs, window = next(((o, w) for o, w in measured if w.basis), measured[0])
    return advise(window, source=obs.source or obs.key, key=obs.key, recorded_at=obs.recorded_at)
