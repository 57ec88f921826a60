"""The accuracy page (``docs/accuracy.md``) and the first-sight ledger its headline comes from.

The ledger (``bench/data/first-sight.jsonl``) holds one dated row per data set scored once, as
it arrived, before anything was changed because of it: the set, the date, the commit whose code
scored it, the command, the figures, and, where they are known, the per-case figures the summary
is computed from (so that pooling several sets is exact). A row is never rewritten: each carries
a digest of its own contents, ``append_row`` refuses a set whose name or content is already
there, and the unit tests recompute every summary from its cases.

The page is written by the bench scripts: each replaces only its own section, between
``<!-- begin: NAME -->`` and ``<!-- end: NAME -->``, stamped with the date, the machine's
conditions and the command, and then refreshes the headline section from the ledger (pooled
first-sight figures first; leave-one-source-out and grouped cross-validation second, read from
the sections the scripts wrote; in-sample figures last, labelled).

Usage: python bench/accuracy_page.py [--check]   # rewrite the headline from the ledger
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_data import stats  # noqa: E402 - bench helper beside this file

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "accuracy.md"
LEDGER = ROOT / "bench" / "data" / "first-sight.jsonl"
HEADLINE = "headline"
_FIGURES = re.compile(r"<!-- figures: (\{.*?\}) -->")


class PageError(Exception):
    """A one-line problem with the page or the ledger, naming the fix."""


# --------------------------------------------------------------------------------------------
# sections of the page


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- begin: {name} -->", f"<!-- end: {name} -->"


def conditions() -> str:
    """The machine a figure was measured on: CPU count and the 1-minute load average."""
    return f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"


def commit() -> str:
    """The short commit of the tree the script runs from ('unknown' outside git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def stamp(command: str) -> str:
    """The line every written section starts with."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"*Written by `{command}` on {when}, commit {commit()}, {conditions()}.*"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with the part between ``name``'s markers replaced by ``body``."""
    begin, end = _markers(name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise PageError(
            f"the page has no '{begin}' … '{end}' pair: "
            "add the two markers where the section belongs"
        )
    return text[: start + len(begin)] + "\n" + body.strip("\n") + "\n" + text[stop:]


def section(text: str, name: str) -> str:
    """The current body of ``name``'s section."""
    begin, end = _markers(name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise PageError(f"the page has no section '{name}': add its begin/end markers")
    return text[start + len(begin) : stop]


def section_figures(text: str, name: str) -> dict[str, Any]:
    """The machine-readable figures a script stored in its section ({} if none)."""
    found = _FIGURES.search(section(text, name))
    return json.loads(found.group(1)) if found else {}


def write_section(
    name: str,
    body: str,
    command: str,
    figures: dict[str, Any] | None = None,
    page: Path | None = None,
) -> None:
    """Replace ``name``'s section with ``body`` (stamped), then refresh the headline."""
    page = page or PAGE
    lines = [stamp(command), ""]
    if figures:
        lines.append(f"<!-- figures: {json.dumps(figures, sort_keys=True)} -->")
    text = replace_section(page.read_text(encoding="utf-8"), name, "\n".join([*lines, body]))
    page.write_text(text, encoding="utf-8")
    write_headline(page)
    print(f"wrote the '{name}' section of {page}")


# --------------------------------------------------------------------------------------------
# the ledger


def digest(row: dict[str, Any]) -> str:
    """SHA-256 of the row's contents without its digest (canonical JSON)."""
    body = {k: v for k, v in row.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def content_sha256(paths: Sequence[Path]) -> str:
    """SHA-256 of the files' bytes, concatenated in order (the set as it arrived)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()


def read_ledger(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or LEDGER
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_row(row: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Add ``row`` (digest set here) to the ledger; refuse a set already there by name or
    content, so a set is scored at first sight once."""
    for old in read_ledger(path):
        if old["face"] == row["face"] and old["set"] == row["set"]:
            raise PageError(
                f"the {row['face']} set '{row['set']}' was scored at first sight on "
                f"{old['date']}: its row is kept as it is; give a new set a new name"
            )
        if row.get("sha256") and old.get("sha256") == row["sha256"]:
            raise PageError(
                f"this content was scored at first sight on {old['date']} as "
                f"'{old['set']}': a set is scored once"
            )
    row = {**row, "digest": ""}
    row["digest"] = digest(row)
    with (path or LEDGER).open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return row


def planner_summary(cases: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """n, median and p90 |relative error| (%), and, where the cases carry a range, the share
    inside it (%) and its median half-width (%), rounded to 0.01."""
    cases = list(cases)
    med, p90 = stats(c["err"] for c in cases)
    out: dict[str, Any] = {
        "n": len(cases),
        "median": round(med, 2),
        "p90": round(p90, 2),
        "in_range": None,
        "half_width": None,
    }
    ranged = [c for c in cases if c.get("low") is not None]
    if ranged and len(ranged) == len(cases):
        inside = sum(c["low"] - 1e-9 <= c["observed"] <= c["high"] + 1e-9 for c in ranged)
        halves = sorted((c["high"] - c["low"]) / 2 / abs(c["predicted"]) * 100 for c in ranged)
        mid = len(halves) // 2
        half = halves[mid] if len(halves) % 2 else (halves[mid - 1] + halves[mid]) / 2
        out.update(in_range=round(100 * inside / len(ranged), 2), half_width=round(half, 2))
    return out


def doctor_summary(cases: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """n, right at top-1 and the top-1 share (%) of per-case outcomes."""
    cases = list(cases)
    right = sum(bool(c["correct"]) for c in cases)
    return {"n": len(cases), "correct": right, "top1": round(100 * right / len(cases), 1)}


def check_row(row: dict[str, Any]) -> list[str]:
    """What is wrong with a ledger row (empty: well-formed, unchanged, summary = its cases)."""
    problems = [
        f"missing {k}"
        for k in ("face", "set", "date", "commit", "command", "summary", "pooled", "digest")
        if k not in row
    ]
    if problems:
        return problems
    if row["digest"] != digest(row):
        problems.append("digest does not match: the row was changed after it was written")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]):
        problems.append(f"date {row['date']!r} is not YYYY-MM-DD")
    cases, summary = row.get("cases"), row["summary"]
    if row["face"] == "planner" and cases:
        if planner_summary(cases) != summary:
            problems.append(f"summary {summary} != recomputed {planner_summary(cases)}")
        problems += [
            f"case {c} has err != |pred - obs| / obs"
            for c in cases
            if abs(abs(c["predicted"] - c["observed"]) / c["observed"] * 100 - c["err"]) > 1e-6
        ]
    elif row["face"] == "doctor":
        if cases and doctor_summary(cases) != summary:
            problems.append(f"summary {summary} != recomputed {doctor_summary(cases)}")
        if round(100 * summary["correct"] / summary["n"], 1) != summary["top1"]:
            problems.append("top1 is not correct / n")
    if row["pooled"] and row["face"] == "planner" and not cases:
        problems.append("a pooled planner row needs its per-case errors")
    return problems


def pooled(rows: Sequence[dict[str, Any]], face: str) -> dict[str, Any] | None:
    """The pooled first-sight figure of ``face`` over its pooled rows (None if it has none)."""
    mine = [r for r in rows if r["face"] == face and r["pooled"]]
    if not mine:
        return None
    if face == "planner":
        out = planner_summary(c for r in mine for c in r["cases"])
    else:
        n = sum(r["summary"]["n"] for r in mine)
        right = sum(r["summary"]["correct"] for r in mine)
        out = {"n": n, "correct": right, "top1": round(100 * right / n, 1)}
    return {
        **out,
        "sets": [r["set"] for r in mine],
        "first": min(r["date"] for r in mine),
        "last": max(r["date"] for r in mine),
    }


# --------------------------------------------------------------------------------------------
# the headline


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} %"


def _span(pool: dict[str, Any]) -> str:
    return pool["first"] if pool["first"] == pool["last"] else f"{pool['first']} to {pool['last']}"


def _sets(pool: dict[str, Any]) -> str:
    count = len(pool["sets"])
    return f"{count} set{'s' if count > 1 else ''} ({', '.join(f'`{s}`' for s in pool['sets'])})"


def _not_pooled(rows: Sequence[dict[str, Any]], face: str) -> list[str]:
    lines = []
    for r in rows:
        if r["face"] == face and not r["pooled"]:
            said = r["summary"].get("reported")
            figure = f"{said}; " if said else ""
            lines.append(f"  Not pooled: `{r['set']}` ({r['date']}): {figure}{r['note']}.")
    return lines


def _planner_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    pool = pooled(rows, "planner")
    if pool is None:
        return ["- **planner**: no set scored at first sight yet."]
    ranged = (
        ""
        if pool["in_range"] is None
        else f"; observed inside the stated range {pool['in_range']:.1f} %, median half-width "
        f"{pool['half_width']:.2f} %"
    )
    lines = [
        f"- **planner, KV cache GiB, first sight (the headline)**: median / p90 |relative "
        f"error| **{_pct(pool['median'])} / {_pct(pool['p90'])}** over {pool['n']} logs "
        f"from {_sets(pool)}, scored {_span(pool)}{ranged}."
    ]
    if pool["in_range"] is None:
        lines.append(
            "  The pooled sets were scored before the planner stated ranges, so the pool has "
            "no range figure; a set kept as reported only is not pooled."
        )
    return lines + _not_pooled(rows, "planner")


def _doctor_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    pool = pooled(rows, "doctor")
    if pool is None:
        return ["- **doctor**: no set scored at first sight yet."]
    lines = [
        f"- **doctor, top-1 root cause from the log, first sight**: **{pool['top1']:.1f} %** "
        f"({pool['correct']} of {pool['n']} cases from {_sets(pool)}, scored "
        f"{_span(pool)}, each by the doctor of its day)."
    ]
    return lines + _not_pooled(rows, "doctor")


def _secondary_lines(text: str) -> list[str]:
    planner, doctor = section_figures(text, "planner"), section_figures(text, "doctor")
    lines = [
        "",
        "Secondary — out of sample, but after the mechanisms were chosen by looking "
        "at every source (so in sample for those choices):",
        "",
    ]
    if planner:
        lines.append(
            f"- planner, leave-one-source-out over {planner['loso_n']} logs: "
            f"{planner['loso_median']:.2f} % / {planner['loso_p90']:.2f} %, observed "
            f"inside the range {planner['loso_in_range']:.1f} % at a median half-width "
            f"of {planner['loso_half_width']:.2f} % ([planner](#planner))"
        )
    if doctor:
        lines.append(
            f"- doctor, cross-validation grouped by thread: top-1 "
            f"{doctor['grouped_top1']:.1f} % of {doctor['n']} cases; by arrival (each "
            f"set by a model trained on the sets before it) {doctor['arrival_top1']:.1f} %"
            " ([doctor](#doctor))"
        )
    lines += ["", "In sample (the constants, bands or weights fitted on these cases):", ""]
    if planner:
        lines.append(
            f"- planner, development logs: {planner['in_sample_median']:.2f} % / "
            f"{planner['in_sample_p90']:.2f} % over {planner['in_sample_n']} logs"
        )
    if doctor:
        lines.append(
            f"- doctor, the shipped model on its training cases: top-1 "
            f"{doctor['in_sample_top1']:.1f} %"
        )
    return lines


def headline_markdown(rows: Sequence[dict[str, Any]], text: str) -> str:
    """The headline section: pooled first-sight figures, then the secondary ones."""
    lines = [
        f"*Written from `bench/data/{LEDGER.name}` ({len(rows)} rows) by "
        "`python bench/accuracy_page.py`, which every bench script below calls.*",
        "",
        "First sight — each set scored once, as it arrived, before anything was changed "
        "for it, with the code of that day:",
        "",
    ]
    lines += _planner_lines(rows) + _doctor_lines(rows)
    lines += [
        "",
        "Each figure is that of the code of its day (the commit in the ledger), and the "
        "planner and the doctor have changed since; the next new set scored with "
        "`--first-sight` or `--new` measures the code as shipped.",
    ]
    return "\n".join(lines + _ledger_table(rows) + _secondary_lines(text))


def _figure(row: dict[str, Any]) -> str:
    s = row["summary"]
    if "reported" in s:
        return f"as reported: {s['reported']}"
    if row["face"] == "doctor":
        return f"top-1 {s['top1']:.1f} % ({s['correct']} of {s['n']})"
    ranged = (
        ""
        if s["in_range"] is None
        else f"; in range {s['in_range']:.1f} % at ±{s['half_width']:.2f} %"
    )
    return f"{s['median']:.2f} % / {s['p90']:.2f} % over {s['n']} logs{ranged}"


def _ledger_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per ledger row: the per-set figures the pooled ones come from."""
    lines = [
        "",
        "| face | set | scored | code | first-sight figure | pooled |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['face']} | `{r['set']}` | {r['date']} | {r['commit']} | {_figure(r)} | "
            f"{'yes' if r['pooled'] else 'no'} |"
        )
    return lines


def write_headline(page: Path | None = None, ledger: Path | None = None) -> None:
    """Rewrite the headline section of the page from the ledger (checked first)."""
    page = page or PAGE
    rows = read_ledger(ledger)
    for row in rows:
        bad = check_row(row)
        if bad:
            raise PageError(f"ledger row '{row.get('set')}': {bad[0]}")
    text = page.read_text(encoding="utf-8")
    page.write_text(
        replace_section(text, HEADLINE, headline_markdown(rows, text)), encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if "--check" in args:
            rows = read_ledger()
            bad = [f"{r.get('set')}: {p}" for r in rows for p in check_row(r)]
            print("\n".join(bad) or f"{len(rows)} ledger rows well-formed")
            return 1 if bad else 0
        write_headline()
    except PageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the headline of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
