"""Train the doctor's cause model on the labelled corpus and write its weights.

Usage: python bench/doctor_train.py [--corpus FILE] [--out FILE] [--check]

Needs scikit-learn (``pip install -e '.[train]'``). The regularisation strength and the
temperature that calibrates the probabilities are chosen by cross-validation grouped by thread
on the corpus itself; the weights go to ``src/oomguard/doctor/data/cause_model.json``, which the
doctor reads at run time with numpy alone. ``--check`` writes nothing and exits 1 when the
shipped weights differ from what the corpus trains (a feature or corpus change not retrained).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from doctor_corpus import CORPUS, read_corpus  # noqa: E402
from oomguard.doctor import training  # noqa: E402
from oomguard.doctor.model import MODEL_PATH, CauseModel  # noqa: E402


def same_weights(a: CauseModel, b: CauseModel, tolerance: float = 1e-3) -> bool:
    """Whether two models have the same features and (nearly) the same weights."""
    return (
        a.features == b.features
        and a.classes == b.classes
        and bool(np.allclose(a.coef, b.coef, atol=tolerance))
        and bool(np.allclose(a.intercept, b.intercept, atol=tolerance))
        and abs(a.temperature - b.temperature) <= tolerance
    )


def main(argv: list[str]) -> int:
    """Train, report, and write (or check) the weights."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out", type=Path, default=MODEL_PATH)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = read_corpus(args.corpus)
    examples = training.examples_of(rows)
    model = training.train(examples)
    meta = dict(model.meta, corpus=args.corpus.name)
    model = CauseModel(
        model.classes, model.features, model.coef, model.intercept, model.temperature, meta
    )
    print(
        f"trained on {meta['cases']} cases ({meta['examples']} examples, {meta['threads']} "
        f"threads): C={meta['C']}, temperature {model.temperature:.3f}, "
        f"{len(model.features)} features, grouped log-loss {meta['grouped_log_loss']} "
        f"({time.perf_counter() - started:.1f} s)"
    )
    if args.check:
        shipped = CauseModel.from_dict(json.loads(args.out.read_text(encoding="utf-8")))
        if same_weights(shipped, CauseModel.from_dict(model.to_dict())):
            print(f"{args.out} matches the corpus")
            return 0
        print(f"{args.out} differs from what the corpus trains: run bench/doctor_train.py")
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(model.to_dict(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
