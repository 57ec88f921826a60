"""The first-sight ledger and the accuracy page written from it.

Every ledger row is well-formed and unchanged since it was written (its digest), its summary is
what its per-case figures give, every held-out set in ``bench/data`` was scored at first sight
before it joined, and the headline of ``docs/accuracy.md`` is the ledger's pooled figure.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

import accuracy_page  # noqa: E402 - the bench helper under test

ROWS = accuracy_page.read_ledger()
PAGE_TEXT = accuracy_page.PAGE.read_text(encoding="utf-8")


def test_the_ledger_has_rows_for_both_faces() -> None:
    faces = {r["face"] for r in ROWS}
    assert faces == {"planner", "doctor"}
    assert any(r["pooled"] for r in ROWS if r["face"] == "planner")


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['face']}:{r['set']}" for r in ROWS])
def test_every_row_is_well_formed_and_unchanged(row: dict[str, Any]) -> None:
    assert accuracy_page.check_row(row) == []
    assert row["digest"] == accuracy_page.digest(row)


@pytest.mark.parametrize(
    "row", [r for r in ROWS if r.get("cases")], ids=lambda r: f"{r['face']}:{r['set']}"
)
def test_each_summary_is_recomputed_from_its_cases(row: dict[str, Any]) -> None:
    cases, summary = row["cases"], row["summary"]
    assert summary["n"] == len(cases)
    if row["face"] == "doctor":
        assert summary["correct"] == sum(c["correct"] for c in cases)
        return
    errors = sorted(abs(c["predicted"] - c["observed"]) / c["observed"] * 100 for c in cases)
    assert [round(e, 9) for e in errors] == sorted(round(c["err"], 9) for c in cases)
    assert summary["median"] == round(statistics.median(errors), 2)
    assert summary["p90"] == round(errors[round(0.9 * (len(errors) - 1))], 2)


def test_the_holdout_first_sight_is_the_recorded_figure() -> None:
    """The planner's held-out set scored 2.55 % / 22.5 % on 21 logs when it arrived."""
    row = next(r for r in ROWS if r["set"] == "startup-logs-holdout")
    assert (row["summary"]["n"], row["summary"]["median"], row["summary"]["p90"]) == (
        21,
        2.55,
        22.54,
    )
    assert row["date"] == "2026-11-21"


def test_an_edited_row_is_caught() -> None:
    row = dict(ROWS[0])
    row["summary"] = {**row["summary"], "median": 0.1}
    assert any("digest" in p for p in accuracy_page.check_row(row))


def test_every_held_out_startup_set_was_scored_at_first_sight() -> None:
    kept = {r["sha256"] for r in ROWS if r["face"] == "planner"}
    for path in sorted((ROOT / "bench" / "data").glob("startup-logs*.jsonl")):
        assert accuracy_page.content_sha256([path]) in kept, f"{path.name} has no first sight"


def test_every_doctor_set_in_the_corpus_has_its_row() -> None:
    corpus = ROOT / "bench" / "data" / "oom-cases-corpus.jsonl"
    sets = {json.loads(line)["set"] for line in corpus.read_text().splitlines() if line}
    files = {Path(f).stem.removeprefix("oom-cases-") for r in ROWS for f in r["files"]}
    assert sets - {"development"} <= files


def test_the_headline_is_the_ledgers_pooled_figure() -> None:
    headline = accuracy_page.section(PAGE_TEXT, accuracy_page.HEADLINE)
    assert headline.strip() == accuracy_page.headline_markdown(ROWS, PAGE_TEXT).strip()
    planner = accuracy_page.pooled(ROWS, "planner")
    doctor = accuracy_page.pooled(ROWS, "doctor")
    assert planner is not None and doctor is not None
    every = [c["err"] for r in ROWS if r["face"] == "planner" and r["pooled"] for c in r["cases"]]
    assert planner["n"] == len(every)
    assert f"**{planner['median']:.2f} % / {planner['p90']:.2f} %** over {len(every)} logs" in (
        headline
    )
    right = sum(r["summary"]["correct"] for r in ROWS if r["face"] == "doctor" and r["pooled"])
    assert f"({right} of {doctor['n']} cases" in headline
    # the headline comes before any other figure of the page
    assert PAGE_TEXT.index("begin: headline") < PAGE_TEXT.index("begin: planner")


def test_append_refuses_a_set_already_scored(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    row = {
        "face": "planner",
        "set": "new",
        "files": [],
        "sha256": "abc",
        "date": "2026-11-28",
        "commit": "x",
        "command": "c",
        "summary": {"n": 0},
        "cases": None,
        "pooled": False,
    }
    kept = accuracy_page.append_row(row, ledger)
    assert kept["digest"] == accuracy_page.digest(kept)
    with pytest.raises(accuracy_page.PageError, match="scored at first sight"):
        accuracy_page.append_row({**row, "sha256": "other"}, ledger)
    with pytest.raises(accuracy_page.PageError, match="scored once"):
        accuracy_page.append_row({**row, "set": "renamed"}, ledger)
    assert len(accuracy_page.read_ledger(ledger)) == 1


def test_a_section_is_replaced_alone() -> None:
    text = (
        "a\n<!-- begin: x -->\nold\n<!-- end: x -->\nb\n<!-- begin: y -->\nkeep\n<!-- end: y -->\n"
    )
    new = accuracy_page.replace_section(text, "x", "new")
    assert new == text.replace("old", "new")
    with pytest.raises(accuracy_page.PageError, match="add the two markers"):
        accuracy_page.replace_section(text, "z", "new")


def test_a_new_planner_set_is_scored_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--first-sight keeps a dated row with every case, refreshes the headline, and refuses the
    same set twice and rows already in the held-out data."""
    import planner_accuracy

    ledger, page = tmp_path / "ledger.jsonl", tmp_path / "accuracy.md"
    ledger.write_text((ROOT / "bench" / "data" / "first-sight.jsonl").read_text())
    page.write_text(PAGE_TEXT)
    monkeypatch.setattr(accuracy_page, "LEDGER", ledger)
    monkeypatch.setattr(accuracy_page, "PAGE", page)
    held = (ROOT / "bench" / "data" / "startup-logs-holdout.jsonl").read_text().splitlines()
    new = tmp_path / "fresh.jsonl"
    rows = [json.loads(line) for line in held[18:21]]
    new.write_text("".join(json.dumps({**r, "source": r["source"] + "#new"}) + "\n" for r in rows))
    assert planner_accuracy.main(["--first-sight", str(new)]) in (0, 1)
    kept = accuracy_page.read_ledger(ledger)[-1]
    assert kept["set"] == "fresh" and kept["pooled"] and kept["cases"]
    assert accuracy_page.check_row(kept) == []
    assert kept["summary"]["in_range"] is not None
    assert "`fresh`" in accuracy_page.section(page.read_text(), "headline")
    assert planner_accuracy.main(["--first-sight", str(new)]) == 2
    seen = tmp_path / "seen.jsonl"
    seen.write_text(held[0] + "\n")
    assert planner_accuracy.main(["--first-sight", str(seen)]) == 2
    assert len(accuracy_page.read_ledger(ledger)) == len(ROWS) + 1


def test_a_new_doctor_set_is_scored_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--new keeps a dated row with every case's outcome and refuses cases the corpus holds."""
    import doctor_eval

    ledger, page = tmp_path / "ledger.jsonl", tmp_path / "accuracy.md"
    ledger.write_text((ROOT / "bench" / "data" / "first-sight.jsonl").read_text())
    page.write_text(PAGE_TEXT)
    monkeypatch.setattr(accuracy_page, "LEDGER", ledger)
    monkeypatch.setattr(accuracy_page, "PAGE", page)
    corpus = (ROOT / "bench" / "data" / "oom-cases-corpus.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in corpus[:3]]
    new = tmp_path / "fresh-cases.jsonl"
    fresh = [
        {k: v for k, v in r.items() if k not in ("id", "thread", "set", "arrival")} for r in rows
    ]
    new.write_text("".join(json.dumps({**r, "source": r["source"] + "#new"}) + "\n" for r in fresh))
    assert doctor_eval.main(["--new", str(new), "--modes", "log"]) == 0
    kept = accuracy_page.read_ledger(ledger)[-1]
    assert (kept["face"], kept["set"], kept["summary"]["n"]) == ("doctor", "fresh-cases", 3)
    assert [c["label"] for c in kept["cases"]] == [r["label"] for r in rows]
    assert accuracy_page.check_row(kept) == []
    pool = accuracy_page.pooled(accuracy_page.read_ledger(ledger), "doctor")
    assert pool is not None and f"({pool['correct']} of {pool['n']} cases" in page.read_text()
    assert doctor_eval.main(["--new", str(new), "--modes", "log"]) == 2
    seen = tmp_path / "seen.jsonl"
    seen.write_text(corpus[0] + "\n")
    assert doctor_eval.main(["--new", str(seen), "--modes", "log"]) == 2
