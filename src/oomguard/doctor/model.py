"""Tier 2: the calibrated ranking — a multinomial logistic regression over named features.

The weights ship as ``data/cause_model.json``, written by ``bench/doctor_train.py`` from the
labelled corpus (``bench/data/oom-cases-corpus.jsonl``); inference needs only numpy. The
probabilities are temperature-scaled so that they hold out of sample (grouped cross-validation
in ``bench/doctor_eval.py`` measures how well): they are the confidences the doctor prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

MODEL_PATH = Path(__file__).resolve().parent / "data" / "cause_model.json"


@dataclass(frozen=True)
class CauseModel:
    """Weights of a multinomial logistic regression: one row of ``coef`` per cause."""

    classes: tuple[str, ...]
    features: tuple[str, ...]
    coef: np.ndarray
    intercept: np.ndarray
    temperature: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)

    def scores(self, values: dict[str, float]) -> np.ndarray:
        """The linear scores of each cause for one feature dict (unknown features ignored)."""
        x = np.array([values.get(name, 0.0) for name in self.features], dtype=float)
        return np.asarray(self.coef @ x + self.intercept, dtype=float)

    def probabilities(self, values: dict[str, float]) -> dict[str, float]:
        """The probability of each cause, best first."""
        z = self.scores(values) / self.temperature
        z = np.exp(z - z.max())
        p = z / z.sum()
        ranked = sorted(zip(self.classes, p.tolist(), strict=True), key=lambda kv: -kv[1])
        return dict(ranked)

    def contributions(self, values: dict[str, float], cause: str, top: int = 4) -> list[str]:
        """The features that pushed ``cause`` up the most (for explanations and debugging)."""
        row = self.coef[self.classes.index(cause)]
        mean = self.coef.mean(axis=0)
        pushes = [
            (float((row[i] - mean[i]) * values[name]), name)
            for i, name in enumerate(self.features)
            if values.get(name)
        ]
        return [name for weight, name in sorted(pushes, reverse=True)[:top] if weight > 0]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``data/cause_model.json`` (weights rounded to 1e-6)."""
        return {
            "format": 1,
            "classes": list(self.classes),
            "features": list(self.features),
            "coef": [[round(float(v), 6) for v in row] for row in self.coef],
            "intercept": [round(float(v), 6) for v in self.intercept],
            "temperature": round(self.temperature, 6),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CauseModel:
        """Read the JSON form; raises ValueError when its shapes do not agree."""
        coef = np.asarray(data["coef"], dtype=float)
        intercept = np.asarray(data["intercept"], dtype=float)
        classes, features = tuple(data["classes"]), tuple(data["features"])
        if coef.shape != (len(classes), len(features)) or intercept.shape != (len(classes),):
            raise ValueError("cause model: coefficient shapes do not match classes × features")
        return cls(
            classes,
            features,
            coef,
            intercept,
            float(data.get("temperature", 1.0)),
            dict(data.get("meta", {})),
        )


@lru_cache(maxsize=4)
def load_model(path: Path = MODEL_PATH) -> CauseModel:
    """The shipped model (cached)."""
    return CauseModel.from_dict(json.loads(path.read_text(encoding="utf-8")))
