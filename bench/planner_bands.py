"""Refitting the fitted constants and deriving the bands, nested leave-one-source-out.

The fitted constants (the non-torch table, the CUDA-graph estimate) are refitted on any subset
of sources from the KV figures (linearised around the built-in values). The bands of the
estimated terms and the KV range's scale come from ``oomguard.memory.bands.derive_bands`` and
``kv_scale_from`` fed with out-of-sample residuals: :func:`derive_fold_bands` runs that whole
procedure on a training set only, so that the headline (:func:`nested_loso`) measures coverage
on sources that set neither the constants nor the band widths it is scored with.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.errors import OomguardError
from oomguard.memory.activation import (
    DEFAULT_COEFFICIENTS,
    Coefficients,
    Estimate,
    activation_peak,
    cudagraph_estimate,
    non_torch_cell,
    non_torch_era,
)
from oomguard.memory.bands import (
    TERM_COVERAGE,
    TERMS,
    ZERO_BANDS,
    Band,
    Residual,
    TermBands,
    activation_group,
    conformal_quantile,
    derive_bands,
    graph_group,
    non_torch_group,
    weights_group,
)
from oomguard.memory.dtypes import dtype_bytes
from oomguard.memory.engine import MemoryPrediction, predict
from oomguard.memory.versions import resolve_era
from oomguard.memory.weights import resolve_model_dtype
from planner_data import GIB, Case, Prepared, score

# --------------------------------------------------------------------------------------------
# the fitted constants

_Getter = Callable[[Coefficients], float]
_Setter = Callable[[Coefficients, float], Coefficients]


def _scalar_param(attr: str) -> tuple[_Getter, _Setter]:
    def get(c: Coefficients) -> float:
        return float(getattr(c, attr))

    def put(c: Coefficients, v: float) -> Coefficients:
        changes: dict[str, Any] = {attr: v}
        return replace(c, **changes)

    return get, put


def _non_torch_param(key: tuple[str, str]) -> tuple[_Getter, _Setter]:
    """The non-torch table's value for ``key``."""

    def get(c: Coefficients) -> float:
        return float(c.non_torch_gib[key])

    def put(c: Coefficients, v: float) -> Coefficients:
        table = dict(c.non_torch_gib)
        table[key] = v
        return replace(c, non_torch_gib=table)

    return get, put


def non_torch_param_name(key: tuple[str, str]) -> str:
    """The refit's name of the non-torch table's row ``key``."""
    return f"non-torch GiB {key[0]}/{key[1]}"


# name → (getter, setter, finite-difference step, (low, high)). The bounds are physical, not
# fitted: non-torch growth lies between 0 and a few GiB; the graph pool between 0 and 2 GiB.
# The forward pass's factors are counted (two or three intermediate-sized tensors, three
# hidden-sized ones) and the sampler's bytes come from vLLM's code: neither is refitted.
PARAMS: dict[str, tuple[_Getter, _Setter, float, tuple[float, float]]] = {
    "graph base GiB": (*_scalar_param("graph_base_gib"), 0.05, (0.0, 2.0)),
    "graph GiB per layer": (*_scalar_param("graph_per_layer_gib"), 0.002, (0.0, 0.1)),
    **{
        non_torch_param_name(key): (*_non_torch_param(key), 0.1, (0.0, 6.0))
        for key in DEFAULT_COEFFICIENTS.non_torch_gib
    },
}  # fmt: skip
GRAPH_PARAMS = frozenset({"graph base GiB", "graph GiB per layer"})

Sensitivities = dict[tuple[str, int], dict[str, float]]


def _weighted_median(values: list[float], weights: list[float]) -> float:
    pairs = sorted(zip(values, weights, strict=True))
    half, acc = sum(weights) / 2, 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


def _kv_bytes(p: Prepared, coef: Coefficients) -> float | None:
    try:
        return float(
            predict(p.model, p.gpu, p.settings, strict=False, coefficients=coef)
            .stages[0]
            .kv_cache_bytes
        )
    except OomguardError:
        return None


def sensitivities(prepared: list[Prepared]) -> Sensitivities:
    """d(KV bytes)/d(constant) of each KV row at the built-in constants (finite differences)."""
    out: Sensitivities = {}
    base = DEFAULT_COEFFICIENTS
    for p in prepared:
        if "kv_cache_gib" not in p.observed:
            continue
        kv0 = _kv_bytes(p, base)
        if kv0 is None:
            continue
        key = (p.dataset, p.row)
        out[key] = {"_pred": kv0}
        for name, (get, put, step, _bounds) in PARAMS.items():
            kv1 = _kv_bytes(p, put(base, get(base) + step))
            if kv1 is not None and kv1 != kv0:
                out[key][name] = (kv1 - kv0) / step
    return out


@dataclass(frozen=True)
class Fit:
    """Constants refitted on some sources, and the constants none of them informs."""

    coef: Coefficients
    unrefitted: frozenset[str]


def refit(train: list[Prepared], sens: Sensitivities) -> Fit:
    """Constants refitted on ``train`` (KV residuals, linearised).

    Each constant in turn takes the median of the values each informed row implies, weighted by
    the row's sensitivity (capped at three times the median weight, so one row cannot decide a
    constant for everyone), clamped to the physical bounds of :data:`PARAMS`; two passes. A
    constant no row of ``train`` informs keeps its built-in value and is named in
    ``unrefitted``: a prediction that uses it is not out of sample.
    """
    rows = [p for p in train if (p.dataset, p.row) in sens]
    delta = {name: 0.0 for name in PARAMS}

    def residual(p: Prepared) -> float:
        s = sens[(p.dataset, p.row)]
        pred = s["_pred"] + sum(s.get(n, 0.0) * d for n, d in delta.items())
        return p.observed["kv_cache_gib"] * GIB - pred

    unrefitted: set[str] = set()
    for pass_no in range(2):
        for name, (get, _put, _step, (low, high)) in PARAMS.items():
            informed = [p for p in rows if abs(sens[(p.dataset, p.row)].get(name, 0.0)) > 1e-3]
            if not informed:
                if pass_no == 0:
                    unrefitted.add(name)
                continue
            implied = [delta[name] + residual(p) / sens[(p.dataset, p.row)][name] for p in informed]
            raw = [abs(sens[(p.dataset, p.row)][name]) for p in informed]
            cap = 3 * statistics.median(raw)
            base_value = get(DEFAULT_COEFFICIENTS)
            fitted = base_value + _weighted_median(implied, [min(w, cap) for w in raw])
            delta[name] = min(high, max(low, fitted)) - base_value
    coef = DEFAULT_COEFFICIENTS
    for name, (get, put, _step, _bounds) in PARAMS.items():
        coef = put(coef, get(DEFAULT_COEFFICIENTS) + delta[name])
    return Fit(coef, frozenset(unrefitted))


def kv_uses_unfitted(p: Prepared, sens: Sensitivities, fit: Fit) -> set[str]:
    """The constants a row's KV figure depends on that ``fit`` could not refit."""
    used = {
        n for n, v in sens.get((p.dataset, p.row), {}).items() if n != "_pred" and abs(v) > 1e-3
    }
    return used & fit.unrefitted


# --------------------------------------------------------------------------------------------
# out-of-sample residuals of the terms


@dataclass(frozen=True)
class TermResidual:
    """A term's out-of-sample error on one log, with what it was computed from."""

    term: str
    residual: Residual
    label: str
    observed: float
    estimate: float


def _first_stage_activation(p: Prepared, pred: MemoryPrediction, coef: Coefficients) -> Estimate:
    """The activation estimate of the logged rank (the first pipeline stage), without a band."""
    s = pred.settings
    ep = s.tensor_parallel_size * s.data_parallel_size if s.enable_expert_parallel else 1
    model_dtype = resolve_model_dtype(p.model, s.dtype, p.gpu.compute_capability)
    return activation_peak(
        p.model,
        era=pred.era,
        max_num_batched_tokens=int(s.max_num_batched_tokens or 0),
        max_num_seqs=int(s.max_num_seqs or 0),
        tp=s.tensor_parallel_size,
        dtype_bytes=dtype_bytes(model_dtype),
        has_sampler=s.pipeline_parallel_size == 1,
        ep=ep,
        dp=s.data_parallel_size,
        coef=coef,
    )


def _graph_estimate(p: Prepared, pred: MemoryPrediction, coef: Coefficients) -> Estimate:
    """The 0.20+ graph formula on a log that prints it (0.18–0.19 print, 0.20+ subtract)."""
    s = pred.settings
    return cudagraph_estimate(
        p.model,
        resolve_era("0.20"),
        stage_layers=pred.stages[0].num_layers,
        max_num_seqs=int(s.max_num_seqs or 256),
        max_num_batched_tokens=int(s.max_num_batched_tokens or 2048),
        enforce_eager=False,
        compute_capability=p.gpu.compute_capability,
        tp=s.tensor_parallel_size,
        coef=coef,
    )


def _relative_outside(observed: float, low: float, high: float) -> float:
    """How far ``observed`` lies outside ``[low, high]``, relative to the nearer end (0 inside)."""
    if observed > high:
        return (observed - high) / max(high, 1e-6)
    if observed < low:
        return (observed - low) / max(low, 1e-6)
    return 0.0


def term_residuals(p: Prepared, fit: Fit) -> list[TermResidual]:
    """Every term the row's log prints, against the estimate with ``fit``'s constants.

    A non-torch or graph figure whose constant ``fit`` could not refit is left out (its
    estimate would use the built-in value, fitted with this row's own source).
    """
    obs = p.raw_observed
    if not p.terms_consistent:
        return []
    coef = replace(fit.coef, bands=ZERO_BANDS)
    try:
        pred = predict(p.model, p.gpu, p.settings, strict=False, coefficients=coef)
    except OomguardError:
        return []
    label = f"{p.dataset} {p.row} {p.model.name[:30]}"
    tp = pred.settings.tensor_parallel_size
    out: list[TermResidual] = []
    if obs.get("activation_peak_gib") is not None:
        a = _first_stage_activation(p, pred, coef)
        seen = float(obs["activation_peak_gib"])
        multimodal = p.model.vision is not None
        group = activation_group(pred.era.engine, pred.era.sampler_path, multimodal)
        r = _relative_outside(seen, a.low_bytes / GIB, a.high_bytes / GIB)
        out.append(TermResidual("activation", Residual(group, p.source, r), label, seen, a.gib))
    if obs.get("non_torch_gib") is not None:
        cell = non_torch_cell(
            pred.era,
            tp=tp,
            pp=pred.settings.pipeline_parallel_size,
            nvlink=p.gpu.nvlink,
            nvls=p.gpu.nvls,
        )
        if cell not in coef.non_torch_gib:
            cell = (cell[0], "single")
        if non_torch_param_name(cell) not in fit.unrefitted:
            seen = float(obs["non_torch_gib"])
            group = non_torch_group(non_torch_era(pred.era), tp)
            value = pred.non_torch.gib
            out.append(
                TermResidual(
                    "non_torch", Residual(group, p.source, seen - value), label, seen, value
                )
            )
    if obs.get("weights_gib") is not None:
        seen, value = float(obs["weights_gib"]), pred.stages[0].weights_bytes / GIB
        quantized = bool(p.model.quant.method or p.settings.quantization)
        group = weights_group(quantized, p.model.vision is not None)
        out.append(
            TermResidual("weights", Residual(group, p.source, seen / value - 1), label, seen, value)
        )
    if obs.get("cudagraph_estimated_gib") is not None and not (GRAPH_PARAMS & fit.unrefitted):
        g = _graph_estimate(p, pred, coef)
        seen = float(obs["cudagraph_estimated_gib"])
        out.append(
            TermResidual(
                "graph", Residual(graph_group(tp), p.source, seen - g.gib), label, seen, g.gib
            )
        )
    return out


def bands_from(residuals: list[TermResidual]) -> TermBands:
    """``derive_bands`` on a list of term residuals."""
    return derive_bands({t: [r.residual for r in residuals if r.term == t] for t in TERMS})


# --------------------------------------------------------------------------------------------
# the procedure on a training set, and the nested leave-one-source-out


def _kv_ratio(pred: MemoryPrediction, observed_gib: float) -> float:
    """The KV error in units of the range's half-width on the error's side."""
    stage = pred.stages[0]
    error = observed_gib * GIB - stage.kv_cache_bytes
    if error >= 0:
        return error / max(stage.kv_cache_bytes_high - stage.kv_cache_bytes, 1)
    return -error / max(stage.kv_cache_bytes - stage.kv_cache_bytes_low, 1)


@dataclass
class FoldBands:
    """The bands the procedure gives on one training set, with the residuals behind them.

    ``kv_ratios`` (only when asked for): each KV figure's out-of-sample error in units of the
    KV range's half-width on its side, the range built from bands derived without its source.
    """

    bands: TermBands
    residuals: list[TermResidual]
    kv_ratios: list[tuple[str, float]] = field(default_factory=list)

    def kv_scale(self) -> float:
        """How far the KV range would have to be stretched to hold ``TERM_COVERAGE`` of the
        out-of-sample KV figures (split conformal over sources); near 1: the summed term bands
        are calibrated as they are."""
        return conformal_quantile(
            [r for _, r in self.kv_ratios], [s for s, _ in self.kv_ratios], TERM_COVERAGE
        )


def derive_fold_bands(
    train: list[Prepared], sens: Sensitivities, check_kv: bool = False
) -> FoldBands:
    """The band procedure on ``train`` only (see ``oomguard.memory.bands``).

    Every source of ``train`` is predicted with the constants refitted on the others, and its
    term residuals feed the bands. With ``check_kv`` every source's KV figures are also scored
    against the range that bands derived without it give.
    """
    sources = sorted({p.source for p in train})
    fits = {s: refit([p for p in train if p.source != s], sens) for s in sources}
    by_source = {
        s: [r for p in train if p.source == s for r in term_residuals(p, fits[s])] for s in sources
    }
    every = [r for rs in by_source.values() for r in rs]
    out = FoldBands(bands_from(every), every)
    for s in sources if check_kv else []:
        rows = [
            p
            for p in train
            if p.source == s
            and "kv_cache_gib" in p.observed
            and not kv_uses_unfitted(p, sens, fits[s])
        ]
        others = [r for s2, rs in by_source.items() if s2 != s for r in rs]
        coef = replace(fits[s].coef, bands=bands_from(others))
        for p in rows:
            try:
                pred = predict(p.model, p.gpu, p.settings, strict=False, coefficients=coef)
            except OomguardError:
                continue
            out.kv_ratios.append((s, _kv_ratio(pred, p.observed["kv_cache_gib"])))
    return out


@dataclass
class TermCheck:
    """A held-out term residual and whether the fold's band (derived without it) holds it."""

    residual: TermResidual
    band: Band
    covered: bool


@dataclass
class NestedResult:
    """Out-of-sample KV cases, rows kept out of the headline, and the held-out term checks."""

    clean: list[Case] = field(default_factory=list)
    leaked: list[Case] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    terms: list[TermCheck] = field(default_factory=list)


def _term_band(bands: TermBands, r: TermResidual) -> Band:
    return bands.table(r.term)[r.residual.group]


def nested_loso(prepared: list[Prepared], sens: Sensitivities) -> NestedResult:
    """Each source predicted with constants refitted, and bands derived, on the others only.

    A row whose prediction depends on a constant no other source informs keeps the value fitted
    with its own source: it is not out of sample and goes to ``leaked``, not the headline.
    """
    out = NestedResult()
    for src in sorted({p.source for p in prepared}):
        test = [p for p in prepared if p.source == src]
        train = [p for p in prepared if p.source != src]
        fold = derive_fold_bands(train, sens)
        fit = refit(train, sens)
        for p in test:
            for r in term_residuals(p, fit):
                band = _term_band(fold.bands, r)
                ok = band.unobserved or abs(r.residual.value) <= band.half_width + 1e-9
                out.terms.append(TermCheck(r, band, ok))
        kv_rows = [p for p in test if "kv_cache_gib" in p.observed]
        if not kv_rows:
            continue
        cases, _ = score(kv_rows, replace(fit.coef, bands=fold.bands))
        stuck: dict[tuple[str, int], set[str]] = {
            (p.dataset, p.row): kv_uses_unfitted(p, sens, fit) for p in kv_rows
        }
        names = set().union(*stuck.values())
        for c in cases:
            if c.metric == "kv_cache_gib":
                (out.leaked if stuck.get((c.dataset, c.row)) else out.clean).append(c)
        if names:
            n_stuck = sum(1 for v in stuck.values() if v)
            out.notes.append(
                f"{src[:70]} ({n_stuck} of {len(kv_rows)} rows): only this "
                f"source informs {', '.join(sorted(names))}"
            )
    return out


# --------------------------------------------------------------------------------------------
# the table as code


def _band_literal(band: Band, digits: int) -> str:
    if band.unobserved:
        return 'Band(0.0, pooled_from="nothing", unobserved=True),'
    pooled = f', "{band.pooled_from}"' if band.pooled_from else ""
    return f"Band({round(band.half_width, digits)}, {band.residuals}, {band.sources}{pooled}),"


_DIGITS = {"activation": 3, "non_torch_gib": 3, "graph_gib": 3, "weights": 4}


def bands_literal(bands: TermBands) -> str:
    """``SHIPPED_BANDS = TermBands(...)`` as Python source, rounded as it is shipped."""
    lines = ["SHIPPED_BANDS = TermBands("]
    for name, digits in _DIGITS.items():
        lines.append(f"    {name}={{")
        lines += [
            f'        "{k}": {_band_literal(b, digits)}' for k, b in getattr(bands, name).items()
        ]
        lines.append("    },")
    lines.append(")")
    return "\n".join(lines)


def rounded(bands: TermBands) -> tuple[Any, ...]:
    """The bands as shipped (rounded), for comparing a derivation with the table."""
    return tuple(
        tuple(
            (k, round(b.half_width, digits), b.residuals, b.sources, b.pooled_from, b.unobserved)
            for k, b in sorted(getattr(bands, name).items())
        )
        for name, digits in _DIGITS.items()
    )
