"""Score `oomguard doctor` on held-out real out-of-memory cases it was not developed against.

Usage: python bench/doctor_holdout.py [CASES.jsonl] [--log-only]

The cases (bench/data/oom-cases-holdout.jsonl) come from public issue threads that are not in
the development set (../shared/data/oom-cases.jsonl); each label was fixed from what the thread
says fixed it (or a maintainer's diagnosis) before the doctor was run on it. Every case is
diagnosed twice through the same entry points as bench/doctor_accuracy.py: from the log alone,
and from the log plus the model, GPU and settings the reporter stated.

Printed per mode: top-1 accuracy (with a 95 % Wilson interval: the set is small), how often the
label is among all findings, the confusion matrix, first-fix agreement (same lever and direction
as the fix that worked, as bench/doctor_accuracy.py defines it), accuracy by label confidence
(and on high-confidence cases alone), and each miss with what the doctor said against the thread.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from doctor_accuracy import (  # noqa: E402
    context_of,
    fix_lever,
    print_confusion,
    row_util,
    worked_levers,
)
from oomguard.doctor.diagnose import diagnose  # noqa: E402
from oomguard.doctor.findings import CAUSES  # noqa: E402
from oomguard.doctor.situation import Context  # noqa: E402
from oomguard.logs import parse_stream  # noqa: E402

DEFAULT_CASES = Path(__file__).resolve().parent / "data" / "oom-cases-holdout.jsonl"
CONFIDENCES = ("high", "medium", "low")
_REQUIRED = ("source", "log", "label", "confidence")


@dataclass(frozen=True)
class Outcome:
    """The doctor's answer on one case in one mode, next to the thread's label."""

    index: int
    source: str
    label: str
    confidence: str
    got: str
    got_confidence: float
    all_causes: tuple[str, ...]
    summary: str
    first_fix: str
    fix_counted: bool
    fix_matched: bool
    worked: str | None
    worked_levers: tuple[str, ...]
    doctor_lever: str

    @property
    def correct(self) -> bool:
        return self.got == self.label


def load_cases(path: Path) -> list[dict[str, Any]]:
    """Read and check the JSONL cases; a malformed row stops the run with its line number."""
    if not path.is_file():
        raise SystemExit(f"no cases file at {path}; pass the JSONL path as the first argument")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{number}: not JSON ({exc.msg})") from None
        missing = [key for key in _REQUIRED if not row.get(key)]
        if missing:
            raise SystemExit(f"{path}:{number}: missing {', '.join(missing)}")
        if row["label"] not in CAUSES:
            raise SystemExit(f"{path}:{number}: label {row['label']!r} is not one of {CAUSES}")
        if row["confidence"] not in CONFIDENCES:
            raise SystemExit(f"{path}:{number}: confidence must be one of {CONFIDENCES}")
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path} holds no cases")
    return rows


def run_case(index: int, row: dict[str, Any], with_context: bool) -> Outcome:
    """Diagnose one case (log only, or log + stated model/GPU/settings) and compare."""
    parsed = parse_stream(row["log"].splitlines())
    diagnosis = diagnose(parsed, context_of(row) if with_context else Context())
    top = diagnosis.top
    fixes = top.ordered_fixes() if top else []
    worked = row.get("fix_that_worked")
    levers = worked_levers(worked, row_util(row)) if worked else set()
    fix_counted = bool(levers)
    fix_matched = False
    doctor_lever = "-"
    if fixes:
        util = diagnosis.derived.get("gpu_memory_utilization", {}).get("value")
        family, direction = fix_lever(fixes[0], util)
        doctor_lever = f"{family} {direction}"
        fix_matched = fix_counted and (family, direction) in levers
    return Outcome(
        index=index,
        source=row["source"],
        label=row["label"],
        confidence=row["confidence"],
        got=top.cause if top else "none",
        got_confidence=top.confidence if top else 0.0,
        all_causes=tuple(f.cause for f in diagnosis.findings),
        summary=top.summary if top else "no OOM recognised in the log",
        first_fix=fixes[0].as_text if fixes else "-",
        fix_counted=fix_counted,
        fix_matched=fix_matched,
        worked=worked,
        worked_levers=tuple(sorted(f"{family} {direction}" for family, direction in levers)),
        doctor_lever=doctor_lever,
    )


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion; (0, 0) when n is 0."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _rate(k: int, n: int) -> str:
    if n == 0:
        return "0/0"
    low, high = wilson_interval(k, n)
    return f"{k}/{n} = {k / n:.1%}  (95% CI {low:.0%}–{high:.0%})"


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def report(outcomes: list[Outcome], title: str) -> dict[str, Any]:
    """Print one mode's figures and misses; return the numbers for the closing summary."""
    n = len(outcomes)
    correct = sum(o.correct for o in outcomes)
    in_any = sum(o.label in o.all_causes for o in outcomes)
    fix_total = sum(o.fix_counted for o in outcomes)
    fix_match = sum(o.fix_matched for o in outcomes)
    print(f"\n== {title} ==")
    print(f"top-1 cause:               {_rate(correct, n)}")
    print(f"label among all findings:  {_rate(in_any, n)}")
    if fix_total:
        print(
            f"first fix = fix that worked: {_rate(fix_match, fix_total)} (cases with a recorded fix)"
        )
    print("by label confidence:")
    for level in CONFIDENCES:
        subset = [o for o in outcomes if o.confidence == level]
        hits = sum(o.correct for o in subset)
        print(f"  {level:<7} {_rate(hits, len(subset))}")
    high = [o for o in outcomes if o.confidence == "high"]
    confusion: Counter[tuple[str, str]] = Counter((o.label, o.got) for o in outcomes)
    print_confusion(confusion)
    counted = [o for o in outcomes if o.fix_counted]
    if counted:
        print("first fix against the fix that worked (lever and direction):")
        for o in counted:
            verdict = "same" if o.fix_matched else "different"
            print(
                f"  case {o.index:>2} worked: {', '.join(o.worked_levers)}; doctor: "
                f"{_short(o.first_fix, 36)} ({o.doctor_lever}) → {verdict}"
            )
    unparsed = [o for o in outcomes if o.worked and not o.fix_counted]
    if unparsed:
        print(
            "recorded fixes the shared lever patterns do not parse (not counted): "
            + ", ".join(f"case {o.index}" for o in unparsed)
        )
    misses = [o for o in outcomes if not o.correct]
    if misses:
        print("misses (thread label → doctor's top cause):")
        for o in misses:
            thread = _short(o.worked, 70) if o.worked else "no confirmed fix"
            print(
                f"  case {o.index:>2} [{o.confidence}] {o.label} → {o.got} ({o.got_confidence:.2f})"
                f"  {o.source}\n"
                f"      doctor: {_short(o.summary, 110)} | first fix: {_short(o.first_fix, 40)}\n"
                f"      thread: {thread}"
            )
    return {
        "correct": correct,
        "n": n,
        "high_correct": sum(o.correct for o in high),
        "high_n": len(high),
        "fix_match": fix_match,
        "fix_total": fix_total,
    }


def main(argv: list[str]) -> int:
    """Run both modes (or only the log-only one with --log-only) and print the figures."""
    paths = [a for a in argv if not a.startswith("--")]
    path = Path(paths[0]) if paths else DEFAULT_CASES
    rows = load_cases(path)
    labels = Counter(row["label"] for row in rows)
    confidences = Counter(row["confidence"] for row in rows)
    print(f"doctor on {len(rows)} held-out cases from {path}")
    print("labels: " + ", ".join(f"{label} {labels[label]}" for label in CAUSES if labels[label]))
    print("label confidence: " + ", ".join(f"{c} {confidences[c]}" for c in CONFIDENCES))
    modes = [False] if "--log-only" in argv else [False, True]
    summary: list[tuple[str, dict[str, Any]]] = []
    for with_context in modes:
        title = "log + reported model/GPU/settings" if with_context else "log only"
        outcomes = [run_case(i, row, with_context) for i, row in enumerate(rows)]
        summary.append((title, report(outcomes, title)))
    print("\n== summary ==")
    for title, figures in summary:
        print(
            f"{title:<36} top-1 {figures['correct']}/{figures['n']}"
            f"  high-confidence {figures['high_correct']}/{figures['high_n']}"
            f"  first fix {figures['fix_match']}/{figures['fix_total']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
