"""Ranges of the estimated terms, from the errors they made on logs they had not seen.

Every estimated part of vLLM's budget — the activation peak, non-torch growth, the CUDA-graph
estimate, and the weights count — carries a band taken from the errors the model made on
startup logs it was not fitted on, grouped by the vLLM era whose mechanism the part follows.
The KV range is the KV budget with every part at the end of its band that lowers (raises) it.
:data:`SHIPPED_BANDS` is what the procedure below gives on every log the project has
(``bench/planner_accuracy.py --bands`` runs it and checks this table); the same procedure, run
inside each leave-one-source-out fold on the other sources only, gives the bands the headline
coverage is measured with, so that no log is scored with a band its own source set.

The procedure (split conformal prediction, grouped by source):

1. **Residuals.** Each log that prints a term is predicted with the fitted constants refitted
   without the log's source. Residual = observed − estimate: relative to the estimate for the
   activation peak and the weights (they scale with the model and batch), in GiB for non-torch
   memory and graphs (library workspaces and NCCL buffers do not). Where the mechanism itself
   leaves two outcomes open (which sampler a release runs), the residual is the distance
   outside that span. A residual whose estimate would use a constant only its own source
   informs is not out of sample and is left out.
2. **Bands.** A group's band is ``±q``: ``q`` is the :data:`TERM_COVERAGE` quantile of the
   residuals' sizes, every source weighing the same however many logs it gave, at the
   finite-sample level ``TERM_COVERAGE × (1 + 1/K)`` for ``K`` sources — with fewer than ten
   sources, the largest error seen. Symmetric, because with a few sources the sign of their
   errors is each machine's bias, not knowledge about the next machine. A group with fewer
   than :data:`MIN_GROUP_RESIDUALS` residuals takes the residuals of its parents — the same
   term pooled over the eras of the same engine, then over every era, then over everything —
   so where a mechanism was seldom observed its band is the spread of more eras, which is
   wider. A term nothing has shown at all may lie anywhere from none to twice its estimate.

Groups follow the mechanisms in ``oomguard.memory.activation``: the activation peak by engine
and sampler implementation (V0; V1 with the sort sampler, 0.10–0.16; V1 with the Triton
sampler, 0.17+), with models whose profile also runs a multimodal encoder on dummy images kept
apart (``/mm``: the encoder is priced by its outputs only, and its errors are not mixed into
text-only models' bands); non-torch growth by snapshot era ("v0": V0 and 0.10, whose snapshot
precedes NCCL's set-up; "v1": 0.11–0.17; "late": 0.18+) and by whether tensor parallelism
creates a communicator; the graph estimate by tensor parallelism (its capture includes NCCL's
first buffers); the weights by checkpoint format (dense or quantized) and multimodal tower.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# each band holds this share of its out-of-sample errors
TERM_COVERAGE = 0.90
# a group with fewer residuals takes its parents'
MIN_GROUP_RESIDUALS = 3

ACTIVATION_GROUPS = ("v0", "v1-sort", "v1-triton", "v0/mm", "v1-sort/mm", "v1-triton/mm")
NON_TORCH_GROUPS = ("v0/one", "v0/tp", "v1/one", "v1/tp", "late/one", "late/tp")
GRAPH_GROUPS = ("one", "tp")
WEIGHTS_GROUPS = ("dense", "quantized", "dense/mm", "quantized/mm")
TERMS = ("activation", "non_torch", "graph", "weights")


@dataclass(frozen=True)
class Band:
    """How far either side of its estimate a term may lie: ``±half_width``.

    Relative for the activation peak and the weights, GiB for non-torch memory and graphs.
    ``residuals`` and ``sources`` count the out-of-sample errors it was taken from;
    ``pooled_from`` names the pool they came from when the band's own group had too few. An
    ``unobserved`` term (no log has shown it) may lie anywhere from none to twice its estimate.
    """

    half_width: float
    residuals: int = 0
    sources: int = 0
    pooled_from: str = ""
    unobserved: bool = False

    def around(self, value: float) -> tuple[float, float]:
        """(low, high) of an absolute estimate ``value`` (never below 0)."""
        if self.unobserved:
            return 0.0, 2.0 * value
        return max(0.0, value - self.half_width), value + self.half_width

    def around_relative(self, low: float, high: float) -> tuple[float, float]:
        """(low, high) of a relative band around the span ``low``–``high`` of an estimate."""
        if self.unobserved:
            return 0.0, 2.0 * high
        return max(0.0, low * (1.0 - self.half_width)), high * (1.0 + self.half_width)


@dataclass(frozen=True)
class TermBands:
    """Every estimated term's band, by group."""

    activation: Mapping[str, Band] = field(hash=False)
    non_torch_gib: Mapping[str, Band] = field(hash=False)
    graph_gib: Mapping[str, Band] = field(hash=False)
    weights: Mapping[str, Band] = field(hash=False)

    def table(self, term: str) -> Mapping[str, Band]:
        """The bands of ``term`` (one of :data:`TERMS`)."""
        return {
            "activation": self.activation,
            "non_torch": self.non_torch_gib,
            "graph": self.graph_gib,
            "weights": self.weights,
        }[term]


ZERO_BAND = Band(0.0)
# no band at all: every estimate collapses onto its mechanism's span (to measure residuals)
ZERO_BANDS = TermBands(
    dict.fromkeys(ACTIVATION_GROUPS, ZERO_BAND),
    dict.fromkeys(NON_TORCH_GROUPS, ZERO_BAND),
    dict.fromkeys(GRAPH_GROUPS, ZERO_BAND),
    dict.fromkeys(WEIGHTS_GROUPS, ZERO_BAND),
)


# --------------------------------------------------------------------------------------------
# groups


def activation_group(engine: str, sampler_path: str, multimodal: bool = False) -> str:
    """The activation band's group: the engine and the sampler implementation the era runs,
    and whether the profile also runs a multimodal encoder (``/mm``)."""
    if engine == "v0":
        group = "v0"
    else:
        group = "v1-triton" if sampler_path == "triton" else "v1-sort"
    return group + "/mm" if multimodal else group


def non_torch_group(snapshot_era: str, tp: int) -> str:
    """The non-torch band's group: snapshot era ("v0", "v1", "late") and one GPU or TP."""
    return f"{snapshot_era}/{'tp' if tp > 1 else 'one'}"


def graph_group(tp: int) -> str:
    """The graph band's group: one GPU or tensor parallel."""
    return "tp" if tp > 1 else "one"


def weights_group(quantized: bool, multimodal: bool) -> str:
    """The weights band's group: checkpoint format and whether a multimodal tower is counted."""
    group = "quantized" if quantized else "dense"
    return group + "/mm" if multimodal else group


def parents(term: str, group: str) -> list[str]:
    """The pools a group falls back to, nearest first."""
    if term in ("activation", "weights"):
        if group.endswith("/mm"):
            return ["mm", "all"]
        return ["v1", "text", "all"] if group.startswith("v1-") else ["text", "all"]
    if term == "non_torch":
        era, kind = group.split("/")
        v1_engine = [f"v1+late/{kind}"] if era in ("v1", "late") else []
        return [*v1_engine, f"all/{kind}", "all"]
    if term == "graph":
        return ["all"]
    raise ValueError(f"unknown term {term!r}")


def in_pool(term: str, pool: str, group: str) -> bool:
    """Whether a residual of ``group`` belongs to ``pool`` (a group or one of its parents)."""
    if pool in ("all", group):
        return True
    if term in ("activation", "weights") and pool in ("v1", "text", "mm"):
        multimodal = group.endswith("/mm")
        if pool == "mm":
            return multimodal
        return not multimodal and (pool == "text" or group.startswith("v1-"))
    if term == "non_torch" and "/" in pool:
        eras, kind = pool.split("/")
        era, own_kind = group.split("/")
        return own_kind == kind and (eras == "all" or era in eras.split("+"))
    return False


# --------------------------------------------------------------------------------------------
# the derivation (pure: residuals in, bands out)


@dataclass(frozen=True)
class Residual:
    """One out-of-sample error of a term: its group, source and value."""

    group: str
    source: str
    value: float


def source_weights(sources: Sequence[str]) -> list[float]:
    """Weights giving every source the same total weight, however many logs it gave."""
    counts: dict[str, int] = {}
    for s in sources:
        counts[s] = counts.get(s, 0) + 1
    return [1.0 / counts[s] for s in sources]


def weighted_quantile(values: Sequence[float], weights: Sequence[float], level: float) -> float:
    """The smallest value whose cumulative weight reaches ``level`` of the total.

    ``level`` ≥ 1 gives the largest value.
    """
    if not values:
        raise ValueError("no values")
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(w for _, w in pairs)
    acc = 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= level * total - 1e-12:
            return value
    return pairs[-1][0]


def conformal_level(level: float, groups: int) -> float:
    """The finite-sample level for ``groups`` exchangeable groups: ``level × (1 + 1/K)``."""
    return min(1.0, level * (1.0 + 1.0 / max(groups, 1)))


def conformal_quantile(sizes: Sequence[float], sources: Sequence[str], level: float) -> float:
    """The split-conformal quantile of ``sizes`` at ``level``, every source weighing the same."""
    k = len(set(sources))
    return weighted_quantile(sizes, source_weights(sources), conformal_level(level, k))


def band_from(residuals: Sequence[Residual], pooled_from: str = "") -> Band:
    """The band ``±q`` holding :data:`TERM_COVERAGE` of ``residuals`` (see the module notes)."""
    q = conformal_quantile(
        [abs(r.value) for r in residuals], [r.source for r in residuals], TERM_COVERAGE
    )
    return Band(q, len(residuals), len({r.source for r in residuals}), pooled_from)


def bands_for_term(
    term: str, groups: Sequence[str], residuals: Sequence[Residual]
) -> dict[str, Band]:
    """Every group's band, falling back to its parents where it has too few residuals."""
    out: dict[str, Band] = {}
    for group in groups:
        for pool in [group, *parents(term, group)]:
            mine = [r for r in residuals if in_pool(term, pool, r.group)]
            if len(mine) >= MIN_GROUP_RESIDUALS or pool == "all":
                if mine:
                    out[group] = band_from(mine, "" if pool == group else pool)
                else:
                    out[group] = Band(0.0, pooled_from="nothing", unobserved=True)
                break
    return out


def derive_bands(residuals: Mapping[str, Sequence[Residual]]) -> TermBands:
    """The bands of every term from its out-of-sample residuals (keyed by :data:`TERMS`)."""
    return TermBands(
        bands_for_term("activation", ACTIVATION_GROUPS, residuals.get("activation", ())),
        bands_for_term("non_torch", NON_TORCH_GROUPS, residuals.get("non_torch", ())),
        bands_for_term("graph", GRAPH_GROUPS, residuals.get("graph", ())),
        bands_for_term("weights", WEIGHTS_GROUPS, residuals.get("weights", ())),
    )


# --------------------------------------------------------------------------------------------
# the shipped table: the procedure above on every startup log (development and held-out sets),
# printed by ``python bench/planner_accuracy.py --bands``; regenerate it there, never by hand.
# Band(half width, residuals, sources[, the pool they came from])

SHIPPED_BANDS = TermBands(
    activation={
        "v0": Band(2.671, 10, 10),
        "v1-sort": Band(0.014, 7, 1),
        "v1-triton": Band(0.14, 34, 1),
        "v0/mm": Band(4.052, 9, 3, "mm"),
        "v1-sort/mm": Band(4.052, 9, 3, "mm"),
        "v1-triton/mm": Band(0.122, 7, 1),
    },
    non_torch_gib={
        "v0/one": Band(1.675, 11, 11),
        "v0/tp": Band(3.029, 49, 15, "all"),
        "v1/one": Band(0.14, 6, 1),
        "v1/tp": Band(3.029, 49, 15, "all"),
        "late/one": Band(0.738, 30, 1),
        "late/tp": Band(3.029, 49, 15, "all"),
    },
    graph_gib={
        "one": Band(0.7, 30, 1),
        "tp": Band(0.923, 11, 1),
    },
    weights={
        "dense": Band(0.0781, 47, 17),
        "quantized": Band(0.0223, 15, 7),
        "dense/mm": Band(0.0053, 8, 3),
        "quantized/mm": Band(0.0053, 9, 3, "mm"),
    },
)
