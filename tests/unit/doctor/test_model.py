"""Tier 2: the shipped cause model, its training, and the corpus it is trained on."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from oomguard.doctor.findings import CAUSES
from oomguard.doctor.model import CauseModel, load_model

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

from doctor_corpus import merge, read_corpus, thread_of  # noqa: E402


def test_the_shipped_model_is_small_and_names_its_features() -> None:
    model = load_model()
    assert model.classes == CAUSES
    assert 30 <= len(model.features) <= 400
    assert 0.2 < model.temperature < 5
    assert model.meta["threads"] >= 300


def test_probabilities_sum_to_one_and_ignore_unknown_features() -> None:
    model = load_model()
    p = model.probabilities({"sig:kv_too_small": 1.0, "no such feature": 5.0})
    assert sum(p.values()) == pytest.approx(1.0)
    assert next(iter(p)) == "kv_too_small_for_max_len"
    assert model.probabilities({}) == model.probabilities({"no such feature": 1.0})


def test_round_trip_through_json() -> None:
    model = load_model()
    again = CauseModel.from_dict(model.to_dict())
    assert again.features == model.features
    assert np.allclose(again.coef, model.coef, atol=1e-6)
    with pytest.raises(ValueError):
        CauseModel.from_dict({**model.to_dict(), "intercept": [0.0]})


def test_the_shipped_weights_are_what_the_corpus_trains() -> None:
    """A change to the features, the checks or the corpus must be followed by retraining."""
    pytest.importorskip("sklearn")
    import doctor_train

    assert doctor_train.main(["--check"]) == 0


@pytest.mark.parametrize(
    ("source", "thread"),
    [
        ("https://github.com/vllm-project/vllm/issues/12345", "github:vllm-project/vllm#12345"),
        (
            "https://github.com/vllm-project/vllm/pull/12345#issuecomment-9",
            "github:vllm-project/vllm#12345",
        ),
        ("https://github.com/Vllm-Project/VLLM/issues/12345/", "github:vllm-project/vllm#12345"),
        ("https://discuss.vllm.ai/t/some-title/1602/3", "discuss.vllm.ai/t/1602"),
        ("https://www.example.com/post?page=2#x", "example.com/post"),
    ],
)
def test_sources_of_one_thread_are_one_thread(source: str, thread: str) -> None:
    assert thread_of(source) == thread


def test_merging_drops_exact_duplicates_and_joins_shared_logs() -> None:
    row = {
        "source": "https://github.com/a/b/issues/1",
        "log": "x  y",
        "label": "other",
        "confidence": "high",
    }
    other = {**row, "source": "https://github.com/c/d/issues/2", "log": "x y"}
    rows = merge([], [row, row], "first")
    assert len(rows) == 1 and rows[0]["arrival"] == 0
    rows = merge(rows, [other], "second")
    assert len(rows) == 2 and rows[1]["arrival"] == 1
    assert rows[1]["thread"] == rows[0]["thread"]  # the same log pasted in two threads


def test_the_corpus_has_unique_ids_and_known_labels() -> None:
    rows = read_corpus()
    assert len({r["id"] for r in rows}) == len(rows) >= 380
    assert {r["label"] for r in rows} <= set(CAUSES)
    assert all(r["thread"] and r["set"] for r in rows)
