"""Score `oomguard doctor` on the labelled corpus: cross-validation grouped by thread.

Usage:
    python bench/doctor_eval.py [--folds 10] [--repeats 3] [--baseline-src DIR] [--by-arrival]
    python bench/doctor_eval.py --new NEW.jsonl      # score a fresh set once, before it is used
    python bench/doctor_eval.py --by-arrival --write-docs   # and write docs/accuracy.md

The headline: every case of ``bench/data/oom-cases-corpus.jsonl`` is diagnosed by a doctor
whose cause model was trained (regularisation and temperature chosen by an inner grouped
cross-validation) without the case's thread. ``--repeats`` reshuffles which threads share a
fold; the figures pool all repeats. Each case is diagnosed from its log alone and from its log
plus the model, GPU and settings its reporter stated.

Printed for each doctor and mode: top-1; top-1 on inputs that hold a vLLM or PyTorch memory
message (a log line, error or traceback, not only prose); top-2; the reliability of the stated
confidences (table and expected calibration error over ten equal-width bins); answers stated at
≥ 0.8 (coverage of all cases, how often right); the sure tier (answers a mechanism check
proved: coverage, precision); abstentions.

``--baseline-src DIR`` scores another source tree of oomguard the same way, on the same cases,
in the same run (``git archive <commit> src | tar -x -C DIR``): a doctor without a trained
model has nothing to cross-validate, so it is scored as it is. ``--by-arrival`` adds the
figure of each set scored by a model trained only on the sets that arrived before it.

``--new`` scores a set at first sight with the shipped doctor and keeps its dated row (every
case's outcome from the log) in the first-sight ledger (``bench/data/first-sight.jsonl``), which
refuses a set whose name or content is already there, or whose cases are already in the corpus;
only then may ``bench/doctor_corpus.py add`` merge it. ``--write-docs`` writes the figures of a
full run into the doctor section of ``docs/accuracy.md`` and refreshes its headline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy_page  # noqa: E402 - bench helper beside this file
from doctor_corpus import CORPUS, case_id, read_corpus, read_set  # noqa: E402

MODES = ("log", "context")
BINS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class Outcome:
    """One diagnosis of one case in one mode, beside the case's label."""

    case: int
    mode: str
    label: str
    causes: tuple[str, ...]  # best first
    confidence: float  # stated for the first cause
    sure: bool
    abstained: bool
    memory_message: bool

    @property
    def got(self) -> str:
        return self.causes[0] if self.causes else "none"

    @property
    def correct(self) -> bool:
        return self.got == self.label


def _context(row: dict[str, Any]) -> Any:
    from oomguard.doctor.situation import Context

    settings = row.get("settings")
    args = (
        {k: v for k, v in settings.items() if v is not None} if isinstance(settings, dict) else {}
    )
    return Context(model=row.get("model"), gpu=row.get("gpu"), args=args)


def diagnose_case(index: int, row: dict[str, Any], mode: str, model: Any = None) -> Outcome:
    """Run the importable doctor on one case (``model`` replaces the shipped cause model)."""
    from oomguard.doctor.diagnose import diagnose
    from oomguard.doctor.situation import Context
    from oomguard.logs import parse_stream

    parsed = parse_stream(str(row["log"]).splitlines())
    context = _context(row) if mode == "context" else Context()
    diagnosis = diagnose(parsed, context, model=model) if model else diagnose(parsed, context)
    top = diagnosis.top
    return Outcome(
        case=index,
        mode=mode,
        label=row["label"],
        causes=tuple(f.cause for f in diagnosis.findings),
        confidence=float(top.confidence) if top else 0.0,
        sure=bool(getattr(top, "sure", False)),
        abstained=bool(getattr(diagnosis, "abstained", False)),
        memory_message=parsed.shows_failure and not parsed.only_said,
    )


# --- the doctors being scored ---------------------------------------------------------------------


def cross_validated(
    rows: Sequence[dict[str, Any]], folds: int, seed: int, modes: Sequence[str]
) -> list[Outcome]:
    """Every case diagnosed by a doctor trained without its thread's fold."""
    from oomguard.doctor import training

    examples = training.examples_of(rows)
    fold = {row["thread"]: training.fold_of(row["thread"], folds, seed) for row in rows}
    out: list[Outcome] = []
    for f in range(folds):
        train = [e for e in examples if fold[e.group] != f]
        model = training.train(train, seed=seed)
        for index, row in enumerate(rows):
            if fold[row["thread"]] == f:
                out.extend(diagnose_case(index, row, mode, model) for mode in modes)
    return sorted(out, key=lambda o: (o.case, o.mode))


def by_arrival(rows: Sequence[dict[str, Any]], modes: Sequence[str]) -> dict[str, list[Outcome]]:
    """Each set scored by a doctor trained only on the sets that arrived before it (threads it
    shares with them are left out of its score)."""
    from oomguard.doctor import training

    examples = training.examples_of(rows)
    arrivals = sorted({row["arrival"] for row in rows})
    out: dict[str, list[Outcome]] = {}
    for arrival in arrivals[2:]:
        earlier = {i for i, row in enumerate(rows) if row["arrival"] < arrival}
        seen = {rows[i]["thread"] for i in earlier}
        model = training.train([e for e in examples if e.case in earlier])
        name = next(row["set"] for row in rows if row["arrival"] == arrival)
        out[name] = [
            diagnose_case(index, row, mode, model)
            for index, row in enumerate(rows)
            if row["arrival"] == arrival and row["thread"] not in seen
            for mode in modes
        ]
    return out


def as_is(rows: Sequence[dict[str, Any]], modes: Sequence[str]) -> list[Outcome]:
    """Every case diagnosed by the importable doctor as shipped."""
    return [diagnose_case(i, row, mode) for i, row in enumerate(rows) for mode in modes]


def baseline(src: Path, corpus: Path, modes: Sequence[str]) -> list[Outcome]:
    """The doctor of another source tree, run in a subprocess on the same cases."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "outcomes.json"
        env = dict(os.environ, PYTHONPATH=str(src / "src"))
        cmd = [
            sys.executable,
            __file__,
            "--predict-only",
            str(out_path),
            "--corpus",
            str(corpus),
            "--modes",
            ",".join(modes),
        ]
        subprocess.run(cmd, env=env, check=True)
        data = json.loads(out_path.read_text())
    print(f"baseline doctor: {data['module']}")
    return [Outcome(**{**o, "causes": tuple(o["causes"])}) for o in data["outcomes"]]


# --- figures -------------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of k successes in n."""
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _rate(k: int, n: int, repeats: int = 1) -> str:
    """``p % (95 % CI) k/n``; with repeats of the same cases the interval is that of one
    repeat (the cases, not their repeats, are the independent draws)."""
    if n == 0:
        return "–"
    low, high = wilson(round(k / repeats), round(n / repeats))
    return f"{k / n:6.1%} ({low:.0%}–{high:.0%}) {k}/{n}"


def expected_calibration_error(outcomes: Sequence[Outcome], bins: int = 10) -> float:
    """Σ over equal-width confidence bins of (bin share) × |accuracy − mean confidence|."""
    total = len(outcomes)
    error = 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        inside = [
            o
            for o in outcomes
            if low <= o.confidence < high or (b == bins - 1 and o.confidence == 1.0)
        ]
        if inside:
            accuracy = sum(o.correct for o in inside) / len(inside)
            mean = sum(o.confidence for o in inside) / len(inside)
            error += len(inside) / total * abs(accuracy - mean)
    return error


def figures(outcomes: Sequence[Outcome]) -> dict[str, str]:
    """The printed figures of one doctor in one mode (pooled over repeats)."""
    n = len(outcomes)
    repeats = max(n // max(len({o.case for o in outcomes}), 1), 1)

    def rate(k: int, m: int) -> str:
        return _rate(k, m, repeats)

    memory = [o for o in outcomes if o.memory_message]
    high = [o for o in outcomes if o.confidence >= 0.8]
    sure = [o for o in outcomes if o.sure]
    answered = [o for o in outcomes if not o.abstained]
    return {
        "top-1": rate(sum(o.correct for o in outcomes), n),
        "top-1, memory message": rate(sum(o.correct for o in memory), len(memory)),
        "top-2": rate(sum(o.label in o.causes[:2] for o in outcomes), n),
        "ECE (10 bins)": f"{expected_calibration_error(outcomes):.3f}",
        "stated ≥ 0.8: coverage": f"{len(high) / n:6.1%} {len(high)}/{n}",
        "stated ≥ 0.8: right": rate(sum(o.correct for o in high), len(high)),
        "sure tier: coverage": f"{len(sure) / n:6.1%} {len(sure)}/{n}",
        "sure tier: precision": rate(sum(o.correct for o in sure), len(sure)),
        "abstained": f"{1 - len(answered) / n:6.1%} {n - len(answered)}/{n}",
        "top-1 when answering": rate(sum(o.correct for o in answered), len(answered)),
    }


def reliability(outcomes: Sequence[Outcome]) -> list[str]:
    """One line per confidence bin: cases, mean stated confidence, how often right."""
    lines = []
    for low, high in zip(BINS, BINS[1:], strict=False):
        inside = [
            o
            for o in outcomes
            if low <= o.confidence < high or (high == 1.0 and o.confidence == 1.0)
        ]
        if inside:
            mean = sum(o.confidence for o in inside) / len(inside)
            right = sum(o.correct for o in inside)
            lines.append(
                f"  {low:.1f}–{high:.1f}: {len(inside):4d} cases, stated {mean:.2f}, "
                f"right {right / len(inside):.2f}"
            )
    return lines


def print_columns(title: str, columns: dict[str, Sequence[Outcome]], modes: Sequence[str]) -> None:
    """Figures side by side: one column per doctor, per mode."""
    print(f"\n== {title} ==")
    for mode in modes:
        heads = list(columns)
        table = {h: figures([o for o in columns[h] if o.mode == mode]) for h in heads}
        label = "log only" if mode == "log" else "log + reported model/GPU/settings"
        print(f"\n-- {label} --")
        print(f"{'':28}" + "".join(f"{h:>34}" for h in heads))
        for key in next(iter(table.values())):
            print(f"{key:28}" + "".join(f"{table[h][key]:>34}" for h in heads))
        for head in heads:
            print(f"reliability, {head}:")
            print("\n".join(reliability([o for o in columns[head] if o.mode == mode])))


# --- entry -------------------------------------------------------------------------------------


def _predict_only(path: Path, corpus: Path, modes: Sequence[str]) -> int:
    import oomguard.doctor.diagnose as module

    outcomes = as_is(read_corpus(corpus), modes)
    path.write_text(
        json.dumps({"module": module.__file__, "outcomes": [asdict(o) for o in outcomes]})
    )
    return 0


def _score_new(path: Path, modes: Sequence[str]) -> int:
    """Score a new set once with the shipped doctor and keep its dated row in the ledger."""
    if not path.is_file():
        raise accuracy_page.PageError(f"{path} is not a file: pass the new set's JSON-lines file")
    rows = read_set(path)
    known = {row["id"] for row in read_corpus(CORPUS)}
    again = [case_id(row) for row in rows if case_id(row) in known]
    if again:
        raise accuracy_page.PageError(
            f"{len(again)} cases of {path} are already in {CORPUS.name} "
            f"(first: {again[0]}): they have no first sight"
        )
    outcomes = as_is(rows, modes)
    print(f"first score of {path} ({len(rows)} cases) by the shipped doctor")
    print_columns("new set, scored once before it is used", {"shipped doctor": outcomes}, modes)
    for o in outcomes:
        if not o.correct and o.mode == "log":
            print(
                f"  case {o.case}: {o.label} → {o.got} ({o.confidence:.2f})  "
                f"{rows[o.case]['source']}"
            )
    cases = [
        {
            "id": case_id(rows[o.case]),
            "label": o.label,
            "got": o.got,
            "confidence": round(o.confidence, 3),
            "correct": o.correct,
        }
        for o in outcomes
        if o.mode == modes[0]
    ]
    sha = accuracy_page.content_sha256([path])
    row = accuracy_page.append_row(
        {
            "face": "doctor",
            "set": path.stem,
            "files": [str(path)],
            "sha256": sha,
            "date": accuracy_page.today(),
            "commit": accuracy_page.commit(),
            "recorded_in": accuracy_page.commit(),
            "command": f"python bench/doctor_eval.py --new {path}",
            "summary": accuracy_page.doctor_summary(cases),
            "cases": cases,
            "pooled": modes[0] == "log",
            "note": f"top-1 from the {modes[0]} by the shipped doctor; scored once as it arrived",
        }
    )
    accuracy_page.write_headline()
    print(
        f"\nkept in {accuracy_page.LEDGER}: {row['summary']}; the headline of "
        f"{accuracy_page.PAGE} is refreshed. The set may now be merged: "
        f"python bench/doctor_corpus.py add {path}"
    )
    return 0


def _top1(outcomes: Sequence[Outcome], mode: str) -> float:
    mine = [o for o in outcomes if o.mode == mode]
    return round(100 * sum(o.correct for o in mine) / max(len(mine), 1), 1)


def doctor_markdown(
    columns: dict[str, Sequence[Outcome]], modes: Sequence[str], cases: int, threads: int
) -> tuple[str, dict[str, float]]:
    """The doctor section of the accuracy page, and the figures the headline reads from it."""
    kinds = {
        "grouped CV": "out of sample (grouped by thread)",
        "shipped, in sample": "in sample (the shipped model's training cases)",
        "by arrival": "by arrival (a model trained on the sets before)",
    }
    heads = [(h, m) for h in columns for m in modes if h in kinds]
    tables = {(h, m): figures([o for o in columns[h] if o.mode == m]) for h, m in heads}
    label = {"log": "log only", "context": "log + reported model/GPU/settings"}
    lines = [
        f"{cases} cases from {threads} threads (`bench/data/oom-cases-corpus.jsonl`).",
        "",
        "| figure | " + " | ".join(f"{kinds[h]}, {label.get(m, m)}" for h, m in heads) + " |",
        "|---|" + "---|" * len(heads),
    ]
    for key in next(iter(tables.values())):
        cells = [" ".join(tables[hm][key].split()) for hm in heads]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", "Rates pool the repeats; the interval (95 %, Wilson) is that of one repeat."]
    log = modes[0]
    figures_out = {
        "n": cases,
        "grouped_top1": _top1(columns["grouped CV"], log),
        "in_sample_top1": _top1(columns["shipped, in sample"], log),
    }
    if "by arrival" in columns:
        figures_out["arrival_top1"] = _top1(columns["by arrival"], log)
    return "\n".join(lines), figures_out


def main(argv: list[str]) -> int:
    """Run the evaluation the arguments ask for."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--folds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--baseline-src", type=Path)
    parser.add_argument("--by-arrival", action="store_true")
    parser.add_argument("--new", type=Path)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--predict-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if args.predict_only:
        return _predict_only(args.predict_only, args.corpus, modes)
    if args.new:
        try:
            return _score_new(args.new, modes)
        except accuracy_page.PageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    rows = read_corpus(args.corpus)
    started = time.perf_counter()
    print(
        f"{len(rows)} cases from {len({r['thread'] for r in rows})} threads ({args.corpus}); "
        f"{args.folds}-fold cross-validation grouped by thread, {args.repeats} repeat(s)"
    )
    columns: dict[str, list[Outcome]] = defaultdict(list)
    spread: list[float] = []
    for seed in range(args.repeats):
        outcomes = cross_validated(rows, args.folds, seed, modes)
        columns["grouped CV"].extend(outcomes)
        logs = [o for o in outcomes if o.mode == modes[0]]
        spread.append(sum(o.correct for o in logs) / len(logs))
    print(f"top-1 ({modes[0]}) by repeat: " + ", ".join(f"{s:.1%}" for s in spread))
    if args.baseline_src:
        columns["baseline (as is)"] = baseline(args.baseline_src, args.corpus, modes)
    print_columns("cross-validation grouped by thread (out of sample)", columns, modes)
    columns["shipped, in sample"] = as_is(rows, modes)
    print_columns(
        "shipped model on its own training cases (in sample)",
        {"shipped, in sample": columns["shipped, in sample"]},
        modes,
    )
    if args.by_arrival or args.write_docs:
        sets = by_arrival(rows, modes)
        print("\n== each set scored by a model trained on the sets before it ==")
        for name, outcomes in sets.items():
            logs = [o for o in outcomes if o.mode == modes[0]]
            print(f"  {name:12} {_rate(sum(o.correct for o in logs), len(logs))}")
        pooled = [o for outcomes in sets.values() for o in outcomes]
        print_columns(
            "all sets, each by the model of the sets before it", {"by arrival": pooled}, modes
        )
        columns["by arrival"] = pooled
    print(
        f"\n{time.perf_counter() - started:.0f} s; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    if args.write_docs:
        body, numbers = doctor_markdown(columns, modes, len(rows), len({r["thread"] for r in rows}))
        command = (
            f"python bench/doctor_eval.py --folds {args.folds} --repeats {args.repeats} "
            "--write-docs"
        )
        accuracy_page.write_section("doctor", body, command, numbers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
