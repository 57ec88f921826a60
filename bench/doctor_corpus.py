"""Build and extend the doctor's labelled corpus: one deduplicated file, grouped by thread.

Usage:
    python bench/doctor_corpus.py build SET.jsonl [SET.jsonl …]   # (re)build from set files
    python bench/doctor_corpus.py add NEW.jsonl                    # a new set joins the corpus
    python bench/doctor_corpus.py show                             # counts by set, label, thread

The corpus (``bench/data/oom-cases-corpus.jsonl``) holds every labelled real case once. Each
row keeps the fields of its set (``source``, ``log``, ``label``, ``confidence``, ``model``,
``gpu``, ``settings``, ``vllm_version``, ``fix_that_worked``, ``notes``) and adds:

- ``id``: a stable hash of the source and the log;
- ``set``: the set the case arrived with, and ``arrival``: that set's position (0 = first);
- ``thread``: the discussion the case comes from. Issues and pull requests of one repository
  share a number space, so ``…/issues/12``, ``…/pull/12#issuecomment-…`` and ``…/issues/12/``
  are one thread; other sites drop fragments, queries, ``www.`` and page numbers. Two rows
  whose logs are identical after whitespace is collapsed are put in one thread too (a log
  pasted in two places is one piece of evidence).

Grouped cross-validation (``bench/doctor_eval.py``) never puts two rows of one thread on both
sides of a split. A new set is scored once with ``doctor_eval.py --new NEW.jsonl`` before it is
added here, and before anything changes because of it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from oomguard.doctor.findings import CAUSES  # the labels the doctor ranks

CORPUS = Path(__file__).resolve().parent / "data" / "oom-cases-corpus.jsonl"
CONFIDENCES = ("high", "medium", "low")
REQUIRED = ("source", "log", "label", "confidence")
_GITHUB = re.compile(
    r"^https?://(?:www\.)?github\.com/([^/]+)/([^/#?]+)/(?:issues|pull|discussions)/(\d+)"
)
_DISCOURSE = re.compile(r"^https?://(?:www\.)?([^/]+)/t/(?:[^/]+/)?(\d+)")


def thread_of(source: str) -> str:
    """The thread a source URL belongs to (see the module docstring)."""
    url = source.strip()
    m = _GITHUB.match(url)
    if m:
        return f"github:{m.group(1).lower()}/{m.group(2).lower()}#{m.group(3)}"
    m = _DISCOURSE.match(url)
    if m:
        return f"{m.group(1).lower()}/t/{m.group(2)}"
    url = re.sub(r"[#?].*$", "", url)
    url = re.sub(r"^https?://(?:www\.)?", "", url).rstrip("/")
    return url.lower()


def case_id(row: dict[str, Any]) -> str:
    """A stable identifier: the hash of the source and the log."""
    digest = hashlib.sha256((row["source"] + "\n" + row["log"]).encode()).hexdigest()
    return digest[:12]


def _log_key(log: str) -> str:
    return hashlib.sha256(" ".join(log.split()).encode()).hexdigest()


def read_set(path: Path) -> list[dict[str, Any]]:
    """Read and check one set file; a malformed row stops the run with its line number."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{number}: not JSON ({exc.msg})") from None
        missing = [key for key in REQUIRED if not row.get(key)]
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


def read_corpus(path: Path = CORPUS) -> list[dict[str, Any]]:
    """The corpus rows, in file order."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def merge(
    existing: list[dict[str, Any]], new_rows: list[dict[str, Any]], set_name: str
) -> list[dict[str, Any]]:
    """``existing`` plus the rows of a new set: exact duplicates dropped, threads assigned."""
    arrival = 1 + max((r["arrival"] for r in existing), default=-1)
    seen_ids = {r["id"] for r in existing}
    out = list(existing)
    for row in new_rows:
        entry = {"id": case_id(row), "set": set_name, "arrival": arrival, **row}
        entry["thread"] = thread_of(row["source"])
        if entry["id"] in seen_ids:
            continue
        seen_ids.add(entry["id"])
        out.append(entry)
    return _join_shared_logs(out)


def _join_shared_logs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Put rows with the same log in one thread (the first thread that holds it)."""
    thread_by_log: dict[str, str] = {}
    renamed: dict[str, str] = {}
    for row in rows:
        key = _log_key(row["log"])
        first = thread_by_log.setdefault(key, row["thread"])
        if first != row["thread"]:
            renamed[row["thread"]] = first
    for row in rows:
        while row["thread"] in renamed:
            row["thread"] = renamed[row["thread"]]
    return rows


def write_corpus(rows: list[dict[str, Any]], path: Path = CORPUS) -> None:
    """Write the corpus, one JSON object a line, keys in a fixed order."""
    order = ("id", "thread", "set", "arrival", "source", "label", "confidence")
    lines = []
    for row in rows:
        ordered = {k: row[k] for k in order if k in row}
        ordered.update({k: v for k, v in row.items() if k not in ordered})
        lines.append(json.dumps(ordered, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def show(rows: list[dict[str, Any]]) -> None:
    """Print what the corpus holds."""
    threads = Counter(r["thread"] for r in rows)
    print(f"{len(rows)} cases from {len(threads)} threads ({CORPUS})")
    shared = {t: n for t, n in threads.items() if n > 1}
    print(f"threads with several cases: {len(shared)} ({sum(shared.values())} cases)")
    print("by set:    " + ", ".join(f"{s} {n}" for s, n in Counter(r["set"] for r in rows).items()))
    print(
        "by label:  "
        + ", ".join(f"{k} {n}" for k, n in Counter(r["label"] for r in rows).most_common())
    )


def main(argv: list[str]) -> int:
    """``build`` / ``add`` / ``show``."""
    if not argv or argv[0] not in ("build", "add", "show"):
        print(__doc__)
        return 2
    command, paths = argv[0], [Path(a) for a in argv[1:]]
    if command == "show":
        show(read_corpus())
        return 0
    rows: list[dict[str, Any]] = [] if command == "build" else read_corpus()
    if not paths:
        raise SystemExit(f"{command}: name at least one set file")
    for path in paths:
        name = path.name.removesuffix(".jsonl").removeprefix("oom-cases-").removeprefix("oom-cases")
        rows = merge(rows, read_set(path), name or "development")
    write_corpus(rows)
    show(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
