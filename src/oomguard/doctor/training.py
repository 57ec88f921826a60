"""Training and grouped cross-validation of the cause model (needs scikit-learn: the ``train``
extra). The doctor itself never imports this module.

A labelled case becomes up to two examples: its log alone, and its log with what the reporter
stated (model, GPU, settings) — the two ways the doctor is used — each weighted one half so a
case counts once. Examples are grouped by thread: no split puts one thread on both sides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from oomguard.doctor.features import extract
from oomguard.doctor.findings import CAUSES
from oomguard.doctor.mechanisms import run_mechanisms
from oomguard.doctor.model import CauseModel
from oomguard.doctor.situation import Context, Situation, build_situation
from oomguard.logs import parse_stream

# inverse L2 strengths tried; the one with the lowest grouped log-loss is kept
C_GRID = (0.1, 0.3, 1.0, 3.0)
# a feature must occur in this many threads to get a weight (rarer ones are noise)
MIN_THREADS = 3
INNER_FOLDS = 5
MODES = ("log", "context")


@dataclass(frozen=True)
class Example:
    """One way of diagnosing one case: its features, label, thread and weight."""

    features: dict[str, float]
    label: str
    group: str
    weight: float
    case: int
    mode: str


def context_of(row: dict[str, Any]) -> Context:
    """What the reporter stated, as the doctor's --model/--gpu/--command context."""
    settings = row.get("settings")
    args = (
        {k: v for k, v in settings.items() if v is not None} if isinstance(settings, dict) else {}
    )
    return Context(model=row.get("model"), gpu=row.get("gpu"), args=args)


def situation_of(row: dict[str, Any], mode: str) -> Situation:
    """The situation the doctor builds for a case in one mode (``log`` or ``context``)."""
    parsed = parse_stream(str(row["log"]).splitlines())
    return build_situation(parsed, context_of(row) if mode == "context" else Context())


def examples_of(rows: Sequence[dict[str, Any]], modes: Iterable[str] = MODES) -> list[Example]:
    """The training examples of the corpus rows (a mode that adds nothing is dropped)."""
    out: list[Example] = []
    modes = tuple(modes)
    for index, row in enumerate(rows):
        variants: list[tuple[str, dict[str, float]]] = []
        for mode in modes:
            s = situation_of(row, mode)
            feats = extract(s, run_mechanisms(s))
            if all(feats != other for _, other in variants):
                variants.append((mode, feats))
        for mode, feats in variants:
            out.append(Example(feats, row["label"], row["thread"], 1 / len(variants), index, mode))
    return out


def _matrix(examples: Sequence[Example], names: Sequence[str]) -> np.ndarray:
    return np.array([[e.features.get(n, 0.0) for n in names] for e in examples], dtype=float)


def vocabulary(examples: Sequence[Example], min_threads: int = MIN_THREADS) -> list[str]:
    """Features seen in at least ``min_threads`` threads, sorted."""
    threads: dict[str, set[str]] = {}
    for e in examples:
        for name, value in e.features.items():
            if value:
                threads.setdefault(name, set()).add(e.group)
    return sorted(n for n, g in threads.items() if len(g) >= min_threads)


def fit(examples: Sequence[Example], c: float, temperature: float = 1.0) -> CauseModel:
    """A logistic regression over ``examples`` (all ten causes kept as classes)."""
    from sklearn.linear_model import LogisticRegression

    names = vocabulary(examples)
    x = _matrix(examples, names)
    y = np.array([CAUSES.index(e.label) for e in examples])
    w = np.array([e.weight for e in examples])
    reg = LogisticRegression(C=c, solver="newton-cg", max_iter=1000, tol=1e-8)
    reg.fit(x, y, sample_weight=w)
    coef = np.zeros((len(CAUSES), len(names)))
    intercept = np.full(len(CAUSES), -20.0)  # a cause never seen in training: never predicted
    for row, cls in enumerate(reg.classes_):
        coef[cls], intercept[cls] = reg.coef_[row], reg.intercept_[row]
    return CauseModel(CAUSES, tuple(names), coef, intercept, temperature)


def mechanism_precision(
    examples: Sequence[Example],
) -> tuple[dict[str, list[float]], list[float]]:
    """For each check and the cause it names: [right, fired] over ``examples`` (weighted, so
    a case counts once), and the same pooled over all checks."""
    table: dict[str, list[float]] = {}
    pooled = [0.0, 0.0]
    for e in examples:
        for name in e.features:
            if not name.startswith("mech:") or name == "mech:any":
                continue
            _, mechanism, cause = name.split(":")
            right = e.weight if cause == e.label else 0.0
            entry = table.setdefault(f"{mechanism}:{cause}", [0.0, 0.0])
            entry[0] += right
            entry[1] += e.weight
            pooled[0] += right
            pooled[1] += e.weight
    rounded = {k: [round(v[0], 3), round(v[1], 3)] for k, v in sorted(table.items())}
    return rounded, [round(pooled[0], 3), round(pooled[1], 3)]


def fold_of(group: str, k: int, seed: int) -> int:
    """A thread's fold: a hash of its name, so the split does not depend on row order."""
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % k


def out_of_fold_scores(examples: Sequence[Example], c: float, k: int, seed: int) -> np.ndarray:
    """Each example's linear scores from a model trained without its thread's fold."""
    folds = [fold_of(e.group, k, seed) for e in examples]
    scores = np.zeros((len(examples), len(CAUSES)))
    for fold in range(k):
        test = [i for i, f in enumerate(folds) if f == fold]
        train = [e for e, f in zip(examples, folds, strict=True) if f != fold]
        if not test or not train:
            continue
        model = fit(train, c)
        for i in test:
            scores[i] = model.scores(examples[i].features)
    return scores


def _nll(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray, t: float) -> float:
    z = scores / t
    z = z - z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-(weights * log_p[np.arange(len(labels)), labels]).sum() / weights.sum())


def best_temperature(scores: np.ndarray, examples: Sequence[Example]) -> tuple[float, float]:
    """The temperature minimising the weighted log-loss of ``scores``, and that loss."""
    labels = np.array([CAUSES.index(e.label) for e in examples])
    weights = np.array([e.weight for e in examples])
    grid = np.exp(np.linspace(np.log(0.3), np.log(4.0), 60))
    losses = [_nll(scores, labels, weights, float(t)) for t in grid]
    best = int(np.argmin(losses))
    return float(grid[best]), float(losses[best])


def train(
    examples: Sequence[Example], grid: Sequence[float] = C_GRID, k: int = INNER_FOLDS, seed: int = 0
) -> CauseModel:
    """Choose C and the temperature by grouped cross-validation on ``examples``, then fit
    on all of them. Nothing outside ``examples`` is looked at."""
    best: tuple[float, float, float] | None = None
    for c in grid:
        t, loss = best_temperature(out_of_fold_scores(examples, c, k, seed), examples)
        if best is None or loss < best[0]:
            best = (loss, c, t)
    assert best is not None
    loss, c, t = best
    model = fit(examples, c, t)
    table, pooled = mechanism_precision(examples)
    meta = {
        "mechanisms": table,
        "mechanisms_pooled": pooled,
        "C": c,
        "inner_folds": k,
        "grouped_log_loss": round(loss, 4),
        "examples": len(examples),
        "cases": len({e.case for e in examples}),
        "threads": len({e.group for e in examples}),
    }
    return CauseModel(model.classes, model.features, model.coef, model.intercept, t, meta)
