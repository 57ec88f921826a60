"""Leak detection: sustained growth of used memory, measured by a robust slope.

vLLM allocates its KV pool once, at startup; after that the memory its processes hold should
plateau. Growth that goes on is a leak, and the question a user has is how long until the
memory runs out. Two things must not be mistaken for one: the noise of real traffic (buffers
that come and go with each batch) and a single step (a warm-up allocation, a new CUDA graph,
the allocator reserving another segment).

:class:`LeakDetector` keeps the median of each ``window / 30`` bucket of samples (so a burst
of transient buffers moves one bucket by little), and over the last ``window_s`` seconds
computes the Theil-Sen slope (the median of the slopes between every pair of buckets: half
the pairs may be outliers without moving it). A leak is suspected when that slope is at
least ``min_rate`` AND the window's ``segments`` parts have non-decreasing medians that rise
in total by at least half what ``min_rate`` would give (sustained growth, which a single step
in one part of the window does not satisfy) AND ``settle_s`` has passed since the pool was
allocated (or watching began). Time to exhaustion is the memory still available divided by
the slope. Pure: samples in, verdicts out; no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from oomguard.watch.rules import (
    LEAK_SEGMENTS,
    LEAK_SETTLE_S,
    LEAK_WINDOW_S,
    MEMORY_LEAK,
)

BUCKETS_PER_WINDOW = 30


def theil_sen_slope(times_s: np.ndarray, values: np.ndarray) -> float:
    """The median of the pairwise slopes ``(v_j - v_i) / (t_j - t_i)`` over all ``i < j``."""
    if len(times_s) < 2:
        return 0.0
    i, j = np.triu_indices(len(times_s), k=1)
    dt = times_s[j] - times_s[i]
    keep = dt > 0
    if not keep.any():
        return 0.0
    return float(np.median((values[j][keep] - values[i][keep]) / dt[keep]))


@dataclass(frozen=True)
class LeakVerdict:
    """What the detector concludes at one moment."""

    ready: bool  # a full window after settling: the verdict means something
    suspected: bool  # sustained growth at or above the minimum rate
    slope_bytes_per_s: float
    rise_bytes: float  # last segment's median minus the first's
    monotone: bool  # every segment's median at least the previous one's
    used_bytes: float  # the latest bucket's median
    time_to_exhaustion_s: float | None  # None: not growing, or nothing known to exhaust


@dataclass
class _Bucket:
    start_s: float
    values: list[float]
    median: float | None = None  # set once the bucket is closed

    def value(self) -> float:
        return self.median if self.median is not None else float(np.median(self.values))


class LeakDetector:
    """Sustained-growth detector for one memory series (a GPU's used bytes, a process's RSS).

    Feed it with :meth:`add` (time in seconds, bytes used, bytes still available or None);
    :meth:`verdict` says whether it looks like a leak. :meth:`reset` forgets everything (the
    engine restarted: a new pool, a new baseline).
    """

    def __init__(
        self,
        *,
        window_s: float = LEAK_WINDOW_S,
        min_rate_bytes_per_s: float = MEMORY_LEAK.threshold,
        segments: int = LEAK_SEGMENTS,
        settle_s: float = LEAK_SETTLE_S,
    ) -> None:
        if window_s <= 0 or min_rate_bytes_per_s <= 0 or segments < 2 or settle_s < 0:
            raise ValueError("window, rate and settle must be positive, segments at least 2")
        self.window_s = window_s
        self.min_rate_bytes_per_s = min_rate_bytes_per_s
        self.segments = segments
        self.settle_s = settle_s
        self.bucket_s = window_s / BUCKETS_PER_WINDOW
        self._buckets: deque[_Bucket] = deque()
        self._started_s: float | None = None
        self._available_bytes: float | None = None
        self._cached: LeakVerdict | None = None

    def reset(self) -> None:
        """Forget every sample (a restart: the memory baseline starts again)."""
        self._buckets.clear()
        self._started_s = None
        self._available_bytes = None
        self._cached = None

    def add(self, t_s: float, used_bytes: float, available_bytes: float | None = None) -> None:
        """One sample: ``used_bytes`` at ``t_s``; ``available_bytes`` is what may still be used."""
        if self._started_s is None:
            self._started_s = t_s
        if t_s - self._started_s < self.settle_s:
            return
        self._available_bytes = available_bytes
        last = self._buckets[-1] if self._buckets else None
        if last is None or t_s - last.start_s >= self.bucket_s:
            if last is not None:
                last.median = float(np.median(last.values))
                self._cached = None  # a bucket closed: the verdict can change
            self._buckets.append(_Bucket(t_s, [used_bytes]))
        else:
            last.values.append(used_bytes)
        while self._buckets and t_s - self._buckets[0].start_s > self.window_s + self.bucket_s:
            self._buckets.popleft()

    def verdict(self) -> LeakVerdict:
        """The verdict over the window's closed buckets (recomputed when one closes)."""
        if self._cached is None:
            self._cached = self._compute()
        v = self._cached
        tte = None
        if v.slope_bytes_per_s > 0 and self._available_bytes is not None:
            tte = max(self._available_bytes, 0.0) / v.slope_bytes_per_s
        return LeakVerdict(
            v.ready, v.suspected, v.slope_bytes_per_s, v.rise_bytes, v.monotone, v.used_bytes, tte
        )

    def _compute(self) -> LeakVerdict:
        buckets = [b for b in self._buckets if b.median is not None]
        if len(buckets) < 2:
            return LeakVerdict(False, False, 0.0, 0.0, False, 0.0, None)
        times = np.array([b.start_s for b in buckets])
        medians = np.array([b.value() for b in buckets])
        span_s = times[-1] - times[0] + self.bucket_s
        ready = span_s >= self.window_s * 0.95
        slope = theil_sen_slope(times, medians)
        bounds = np.linspace(0, len(medians), self.segments + 1).astype(int)
        part_medians = [
            float(np.median(medians[a:b]))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            if b > a
        ]
        monotone = all(b >= a for a, b in zip(part_medians[:-1], part_medians[1:], strict=True))
        rise = part_medians[-1] - part_medians[0]
        needed_rise = 0.5 * self.min_rate_bytes_per_s * span_s * (1 - 1 / len(part_medians))
        suspected = (
            ready and slope >= self.min_rate_bytes_per_s and monotone and rise >= needed_rise
        )
        return LeakVerdict(ready, suspected, slope, rise, monotone, float(medians[-1]), None)


def replay(
    samples: list[tuple[float, float]],
    available_bytes: float | None = None,
    detector: LeakDetector | None = None,
) -> list[tuple[float, LeakVerdict]]:
    """Feed a recorded trace ``[(t_s, used_bytes)…]`` through a detector, one verdict a sample.

    ``available_bytes`` is what the trace's process could still have used at its start (the
    time to exhaustion counts down from it as the memory grows).
    """
    det = detector or LeakDetector()
    out: list[tuple[float, LeakVerdict]] = []
    first = samples[0][1] if samples else 0.0
    for t_s, used in samples:
        left = None if available_bytes is None else available_bytes - (used - first)
        det.add(t_s, used, left)
        out.append((t_s, det.verdict()))
    return out
