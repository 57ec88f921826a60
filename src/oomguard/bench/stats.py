"""Percentiles of latency lists (linear interpolation, as numpy's default)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

QUANTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of already sorted values (None for none)."""
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    frac = pos - low
    return float(sorted_values[low] * (1 - frac) + sorted_values[high] * frac)


def summarize(values: Iterable[float | None]) -> dict[str, float | None]:
    """count, mean, p50, p90, p99 and max of the values that are not None (seconds, 4 dp)."""
    clean = sorted(float(v) for v in values if v is not None)
    out: dict[str, float | None] = {"count": float(len(clean))}
    out["mean"] = round(sum(clean) / len(clean), 4) if clean else None
    for q in QUANTILES:
        value = percentile(clean, q)
        out[f"p{q}"] = None if value is None else round(value, 4)
    out["max"] = round(clean[-1], 4) if clean else None
    return out
