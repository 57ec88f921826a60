"""Predicted against observed: the memory model's terms beside the numbers vLLM printed.

Each :class:`Term` names a number of vLLM's startup report, the log fields that state it and
how the prediction gives it. A term is compared once its line has appeared; the difference is
observed − predicted, and ``in_range`` says whether the observation fell inside the
prediction's stated uncertainty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomguard.logs import ParsedLog
from oomguard.units import GIB

if TYPE_CHECKING:
    from oomguard.memory.engine import MemoryPrediction


@dataclass(frozen=True)
class Term:
    """One number of vLLM's startup report."""

    name: str
    label: str
    fields: tuple[str, ...]  # ParsedLog fields that state it, first found wins
    unit: str  # "GiB", "tokens", "x"


TERMS: tuple[Term, ...] = (
    Term("weights", "weights", ("weights_gib",), "GiB"),
    Term("activation", "activation peak", ("activation_gib",), "GiB"),
    Term("non_torch", "non-torch", ("non_torch_gib",), "GiB"),
    Term("cudagraph", "CUDA graphs", ("cudagraph_actual_gib", "cudagraph_estimate_gib"), "GiB"),
    # the CPU worker's resident memory outside the KV cache (weights, activations, runtime)
    Term("cpu_non_kv", "non-KV memory (CPU worker)", ("cpu_non_kv_gib",), "GiB"),
    Term("kv_cache_gib", "KV cache", ("available_kv_gib",), "GiB"),
    Term("kv_cache_tokens", "KV tokens", ("kv_tokens",), "tokens"),
    Term("max_concurrency", "max concurrency", ("max_concurrency",), "x"),
)
TERM_BY_FIELD: dict[str, Term] = {f: t for t in TERMS for f in t.fields}


@dataclass(frozen=True)
class Predicted:
    """A predicted value with its range (low == high for an exact figure)."""

    value: float
    low: float
    high: float
    basis: str = ""


@dataclass(frozen=True)
class Comparison:
    """One term: predicted, observed, and the difference."""

    term: Term
    observed: float
    line: int
    predicted: Predicted | None

    @property
    def diff(self) -> float | None:
        """observed − predicted."""
        return None if self.predicted is None else self.observed - self.predicted.value

    @property
    def diff_pct(self) -> float | None:
        """The difference as a percentage of the observed value."""
        diff = self.diff
        if diff is None or self.observed == 0:
            return None
        return 100.0 * diff / abs(self.observed)

    @property
    def in_range(self) -> bool | None:
        """Whether the observation lies inside the predicted range (log rounding allowed)."""
        if self.predicted is None:
            return None
        slack = _printed_precision(self.term)
        return self.predicted.low - slack <= self.observed <= self.predicted.high + slack

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the ``compare`` event's payload)."""
        out: dict[str, Any] = {
            "term": self.term.name,
            "label": self.term.label,
            "unit": self.term.unit,
            "observed": _round(self.observed, self.term),
            "line": self.line,
        }
        if self.predicted is not None:
            out.update(
                predicted=_round(self.predicted.value, self.term),
                range=[
                    _round(self.predicted.low, self.term),
                    _round(self.predicted.high, self.term),
                ],
                diff=_round(self.diff or 0.0, self.term),
                diff_pct=None if self.diff_pct is None else round(self.diff_pct, 2),
                in_range=self.in_range,
                basis=self.predicted.basis,
            )
        return out


def _printed_precision(term: Term) -> float:
    # vLLM prints GiB to two decimals and concurrency to two; tokens are exact
    return {"GiB": 0.005, "x": 0.005}.get(term.unit, 0.0)


def _round(value: float, term: Term) -> float | int:
    if term.unit == "tokens":
        return int(round(value))
    return round(value, 4 if term.unit == "GiB" else 2)


def predicted_terms(p: MemoryPrediction) -> dict[str, Predicted]:
    """The prediction's value and range for every term of :data:`TERMS` (the KV figures'
    ranges are the memory model's own: every estimated term at either end of its range)."""

    def est(e: Any) -> Predicted:
        return Predicted(e.value_bytes / GIB, e.low_bytes / GIB, e.high_bytes / GIB, e.basis)

    out = {
        "weights": est(p.weights),
        "activation": est(p.activation),
        "non_torch": est(p.non_torch),
        "cudagraph": est(p.cudagraph),
    }
    # the KV budget before a --num-gpu-blocks-override: what vLLM prints as the available KV
    # memory (the most constrained pipeline stage)
    budget = min((s.kv_cache_bytes for s in p.stages), default=p.kv_cache_bytes)
    kv_low, kv_high = _range(p.kv_cache_bytes_range, budget)
    out["kv_cache_gib"] = Predicted(budget / GIB, kv_low / GIB, kv_high / GIB, "budget")
    if p.settings.platform == "cpu" and p.settings.kv_cache_memory_bytes is None:
        # the worker's resident memory outside the pool: the request less the budget
        requested = p.requested_bytes
        out["cpu_non_kv"] = Predicted(
            (requested - budget) / GIB,
            (requested - kv_high) / GIB,
            (requested - kv_low) / GIB,
            "weights + activation + runtime",
        )
    tokens = float(p.kv_cache_tokens)
    t_low, t_high = _range(p.kv_cache_tokens_range, tokens)
    out["kv_cache_tokens"] = Predicted(tokens, t_low, t_high, "blocks")
    conc = float(p.max_concurrency)
    c_low, c_high = _range(p.max_concurrency_range, conc)
    out["max_concurrency"] = Predicted(conc, c_low, c_high, "blocks")
    return out


def _range(stated: tuple[float, float], value: float) -> tuple[float, float]:
    """The model's (low, high) around ``value``; (value, value) where it states none."""
    low, high = stated
    if not low and not high:
        return value, value
    return min(low, value), max(high, value)


def observed_value(parsed: ParsedLog, term: Term) -> tuple[float, int] | None:
    """(value, line) of ``term`` as the log states it, or None."""
    for name in term.fields:
        obs = parsed.fields.get(name)
        if obs is not None and isinstance(obs.value, (int, float)):
            return float(obs.value), obs.evidence.line
    return None


def compare(parsed: ParsedLog, predicted: dict[str, Predicted] | None) -> list[Comparison]:
    """Every term the log states, beside its prediction (None when there is none)."""
    rows = []
    for term in TERMS:
        found = observed_value(parsed, term)
        if found is None:
            continue
        rows.append(
            Comparison(
                term, found[0], found[1], None if predicted is None else predicted.get(term.name)
            )
        )
    return rows
