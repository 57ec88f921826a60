"""Score the memory model's KV-cache budget against real vLLM startup logs, out of sample first.

Every usable row (observed "Available KV cache memory" and/or "Model loading took") is resolved
offline, the engine settings it ran with are rebuilt, and the planner predicts the rank's KV
budget with its range. Printed, in order:

1. OUT OF SAMPLE (the headline): every log — the development logs and every held-out set
   (``bench/data/startup-logs*.jsonl``, which have informed the constants since they were first
   scored) — predicted leave-one-source-out, nested: for each source left out, the few fitted
   constants (the non-torch table, the CUDA-graph estimate) are refitted on the other sources,
   and the bands of the estimated terms and the KV range's scale are derived from the other
   sources' out-of-sample errors by the procedure of ``oomguard.memory.bands`` (which itself
   leaves each of those sources out in turn). The left-out source sets neither the constants
   nor the band widths it is scored with. A row that depends on a constant no other source
   informs keeps the value fitted with its own source: it is not out of sample, so it is
   reported beside the headline, not in it. Beside it, on the very same cases, the naive
   ``util × total − weights − 1 GiB``. Then how often the observed KV lies inside the stated
   range, and the range's median half-width, per data set and by vLLM era; and how often each
   term's observed value lies inside its band, derived without its source.
2. The shipped bands: the same procedure on every log, checked against
   ``oomguard.memory.bands.SHIPPED_BANDS`` (``--bands`` prints the table as code).
3. IN SAMPLE (secondary): the development logs with the built-in constants and bands.
4. Weights GiB (no fitted constant: parameter counts and formats).

``--data FILE`` scores one file as unseen data only, printing the figures and keeping nothing.
``--first-sight FILE`` is how a new set is scored once, as it arrives: the shipped constants and
bands score it, and its dated row (every case's error and range) is appended to the first-sight
ledger (``bench/data/first-sight.jsonl``), which refuses a set whose name or content is already
there, or whose rows are already in the development or held-out data; only then may the set join
them (``bench/data/startup-logs-NAME.jsonl``). ``--write-docs`` writes the figures of a full run
into the planner section of ``docs/accuracy.md`` and refreshes its headline.

Usage: python bench/planner_accuracy.py [--dev PATH] [--holdout PATH ...] [--data PATH]
       [--first-sight PATH] [--write-docs] [--bands] [--terms] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy_page  # noqa: E402 - bench helper beside this file
from oomguard.memory.bands import SHIPPED_BANDS, TERM_COVERAGE  # noqa: E402
from planner_bands import (  # noqa: E402 - bench helpers beside this file
    FoldBands,
    NestedResult,
    TermCheck,
    bands_literal,
    derive_fold_bands,
    nested_loso,
    rounded,
    sensitivities,
)
from planner_data import (  # noqa: E402
    HERE,
    HOLDOUT_GLOB,
    Case,
    Prepared,
    default_dev,
    load_rows,
    prepare,
    score,
    stats,
)

# the targets for the out-of-sample KV figure
TARGET_MEDIAN, TARGET_P90, TARGET_RATIO = 2.0, 8.0, 0.67
TARGET_COVERAGE, TARGET_HALF_WIDTH = 90.0, 5.0
ERA_ORDER = ("V0 engine", "0.10-0.11", "0.12-0.17", "0.18-0.19", "0.20-0.26", "0.27+")


# --------------------------------------------------------------------------------------------
# printing


def _line(label: str, cases: list[Case]) -> str:
    kv = [c for c in cases if c.metric == "kv_cache_gib"]
    if not kv:
        return f"  {label:34s} n= 0"
    med, p90 = stats(c.rel_err_pct for c in kv)
    naive = [c.naive_err_pct for c in kv if c.naive_err_pct is not None]
    n_med, n_p90 = stats(naive)
    cover = 100 * sum(c.covered for c in kv) / len(kv)
    half = statistics.median(c.half_width_pct for c in kv)
    return (
        f"  {label:34s} n={len(kv):3d}  median {med:5.2f}%  p90 {p90:6.2f}%   naive {n_med:5.2f}% "
        f"/ {n_p90:6.2f}%   in range {cover:5.1f}%  half-width {half:4.2f}%"
    )


def print_headline(oos: list[Case]) -> int:
    """The out-of-sample figures against the targets; returns 0 when all are met."""
    kv = [c for c in oos if c.metric == "kv_cache_gib"]
    med, p90 = stats(c.rel_err_pct for c in kv)
    n_med, n_p90 = stats(c.naive_err_pct for c in kv if c.naive_err_pct is not None)
    cover = 100 * sum(c.covered for c in kv) / len(kv)
    half = statistics.median(c.half_width_pct for c in kv)
    ratio = med / n_med if n_med else float("nan")
    checks = [
        (f"KV GiB median |rel err| {med:.2f}% (target ≤ {TARGET_MEDIAN}%)", med <= TARGET_MEDIAN),
        (f"KV GiB p90 |rel err| {p90:.2f}% (target ≤ {TARGET_P90}%)", p90 <= TARGET_P90),
        (
            f"naive util × total − weights − 1 GiB on the same {len(kv)} cases: median "
            f"{n_med:.2f}%, p90 {n_p90:.2f}%; oomguard/naive median = {ratio:.2f}× "
            f"(target ≤ {TARGET_RATIO}×)",
            ratio <= TARGET_RATIO,
        ),
        (
            f"observed KV inside the stated range: {cover:.1f}% (target ≥ {TARGET_COVERAGE:.0f}%)",
            cover >= TARGET_COVERAGE,
        ),
        (
            f"median half-width of the range: {half:.2f}% (target ≤ {TARGET_HALF_WIDTH}%)",
            half <= TARGET_HALF_WIDTH,
        ),
    ]
    print(
        f"OUT OF SAMPLE — leave-one-source-out over the development logs and every held-out "
        f"set, n={len(kv)} KV cases:"
    )
    for text, ok in checks:
        print(f"  [{'met' if ok else 'NOT met'}] {text}")
    return 0 if all(ok for _, ok in checks) else 1


def print_breakdown(oos: list[Case]) -> None:
    """The out-of-sample line per data set and per vLLM era."""
    print("\nby data set (out of sample):")
    for name in sorted({c.dataset for c in oos}):
        print(_line(name, [c for c in oos if c.dataset == name]))
    print("by vLLM era (out of sample):")
    for era in ERA_ORDER:
        mine = [c for c in oos if c.era == era]
        if mine:
            print(_line(era, mine))


def print_cases(cases: list[Case], verbose: bool, worst: int = 8) -> None:
    """The worst cases (every case with ``verbose``), a "!" marking those outside the range."""
    kv = sorted((c for c in cases if c.metric == "kv_cache_gib"), key=lambda c: -c.rel_err_pct)
    print(
        f"\n{'all' if verbose else f'{worst} worst'} out-of-sample KV cases "
        "(obs, pred [range], naive):"
    )
    for c in kv if verbose else kv[:worst]:
        mark = " " if c.covered else "!"
        naive = f"{c.naive:7.2f}" if c.naive is not None else "      -"
        print(
            f" {mark}{c.dataset[:8]:8s} {c.row:2d} {c.model[:36]:36s} {c.version:9s} obs "
            f"{c.observed:7.2f} pred {c.predicted:7.2f} [{c.low:6.2f},{c.high:6.2f}] "
            f"({c.rel_err_pct:5.1f}%) naive {naive}  {c.why}"
        )


def print_weights(cases: list[Case]) -> None:
    """The weights figure, which no fitted constant touches."""
    w = [c for c in cases if c.metric == "weights_gib"]
    med, p90 = stats(c.rel_err_pct for c in w)
    print(
        f"\nweights GiB (no fitted constant): n={len(w)}  median |rel err| {med:.2f}%  "
        f"p90 {p90:.2f}%"
    )
    for c in sorted(w, key=lambda c: -c.rel_err_pct)[:4]:
        print(
            f"   {c.dataset[:8]:8s} {c.row:2d} {c.model[:40]:40s} obs {c.observed:6.2f} "
            f"pred {c.predicted:6.2f} ({c.rel_err_pct:4.1f}%)"
        )


def print_terms(checks: list[TermCheck], verbose: bool) -> None:
    """How often each held-out term lies inside the band derived without its source."""
    print(
        "\neach term's observed value inside its band, the band derived without the log's "
        "source (nested):"
    )
    for term in ("activation", "non_torch", "graph", "weights"):
        mine = [c for c in checks if c.residual.term == term]
        for group in dict.fromkeys(c.residual.residual.group for c in mine):
            rows = [c for c in mine if c.residual.residual.group == group]
            values = sorted(c.residual.residual.value for c in rows)
            relative = term in ("activation", "weights")
            unit, scale, sign = ("", 100, "%") if relative else (" GiB", 1, "")
            print(
                f"  {term:10s} {group:9s} n={len(rows):3d}  in band "
                f"{sum(c.covered for c in rows):3d}"
                f"/{len(rows):3d}   error {values[0] * scale:+7.2f}{sign} … "
                f"{values[-1] * scale:+7.2f}{sign}{unit}"
            )
            for c in rows if verbose else []:
                if not c.covered:
                    r = c.residual
                    print(
                        f"      outside: {r.label:44s} obs {r.observed:6.2f} est {r.estimate:6.2f} "
                        f"band ±{c.band.half_width:.3f}"
                    )
    inside = sum(c.covered for c in checks)
    print(f"  all terms: {inside}/{len(checks)} inside")


def print_bands(derived: FoldBands, show: bool) -> bool:
    """Whether the shipped table is what the procedure gives on every log; the table itself
    with ``show``."""
    same = rounded(derived.bands) == rounded(SHIPPED_BANDS)
    print(
        "\nshipped bands (oomguard.memory.bands.SHIPPED_BANDS) = the procedure on every log: "
        f"{'yes' if same else 'NO — regenerate with --bands'}"
    )
    scale = derived.kv_scale()
    print(
        f"  KV check: stretching the KV ranges by {scale:.2f}× would make them hold "
        f"{TERM_COVERAGE:.0%} of the out-of-sample KV figures of {len(derived.kv_ratios)} logs "
        "(split conformal over sources; near 1: the summed term bands are calibrated as they "
        "are)"
    )
    if show or not same:
        print(bands_literal(derived.bands))
    return same


def _report_skips(skipped: list[str], verbose: bool) -> None:
    print(f"rows not scored: {len(skipped)}")
    for line in skipped if verbose else skipped[:12]:
        print(f"  {line}")
    if not verbose and len(skipped) > 12:
        print(f"  … {len(skipped) - 12} more (--verbose lists them)")


def print_leaked(result: NestedResult) -> None:
    """The rows kept out of the headline, and why."""
    if not result.leaked:
        return
    print(
        "\nNOT OUT OF SAMPLE (kept out of the headline) — rows whose prediction uses a "
        "constant no other source informs, so it keeps the value fitted with them:"
    )
    for line in result.notes:
        print(f"  {line}")
    print(_line("leaked rows", result.leaked))
    print(_line("headline + leaked rows", result.clean + result.leaked))


# --------------------------------------------------------------------------------------------
# the accuracy page and the first-sight ledger


def kv_figures(cases: list[Case]) -> dict[str, float]:
    """The KV figures of ``cases``: n, median and p90 error, the naive formula's, the share
    inside the range and its median half-width (all %)."""
    kv = [c for c in cases if c.metric == "kv_cache_gib"]
    med, p90 = stats(c.rel_err_pct for c in kv)
    n_med, n_p90 = stats(c.naive_err_pct for c in kv if c.naive_err_pct is not None)
    nan = float("nan")
    return {
        "n": len(kv),
        "median": med,
        "p90": p90,
        "naive_median": n_med,
        "naive_p90": n_p90,
        "in_range": 100 * sum(c.covered for c in kv) / len(kv) if kv else nan,
        "half_width": statistics.median(c.half_width_pct for c in kv) if kv else nan,
    }


def _row(what: str, kind: str, f: dict[str, float], ranges: bool = True) -> str:
    ranged = f" | {f['in_range']:.1f} % / {f['half_width']:.2f} %" if ranges else " | —"
    return f"| {what} | {kind} | {f['n']} | {f['median']:.2f} % / {f['p90']:.2f} %{ranged} |"


def _term_cells(checks: list[TermCheck]) -> str:
    cells = []
    for term in ("activation", "non_torch", "graph", "weights"):
        mine = [c for c in checks if c.residual.term == term]
        if mine:
            cells.append(f"{term} {sum(c.covered for c in mine)}/{len(mine)}")
    inside = sum(c.covered for c in checks)
    share = 100 * inside / max(len(checks), 1)
    return f"{inside} of {len(checks)} ({share:.0f} %): " + ", ".join(cells)


def planner_markdown(
    result: NestedResult, in_sample: list[Case], weights: list[Case], bands_same: bool
) -> tuple[str, dict[str, float]]:
    """The planner section of the accuracy page, and the figures the headline reads from it."""
    oos, ins = kv_figures(result.clean), kv_figures(in_sample)
    ratio = oos["median"] / oos["naive_median"] if oos["naive_median"] else float("nan")
    lines = [
        "| KV cache GiB | kind | logs | median / p90 \\|relative error\\| | inside the range / "
        "median half-width |",
        "|---|---|---|---|---|",
        _row(
            "leave-one-source-out, nested: the development logs and every held-out set, each "
            "source predicted with the constants refitted and the bands derived on the other "
            "sources",
            "secondary (leave-one-source-out)",
            oos,
        ),
        f"| the naive `util × total − weights − 1 GiB`, same cases | out of sample | {oos['n']} | "
        f"{oos['naive_median']:.2f} % / {oos['naive_p90']:.2f} % (oomguard's median "
        f"{ratio:.2f}× the naive one; target ≤ {TARGET_RATIO}×) | — |",
    ]
    for name in sorted({c.dataset for c in result.clean}):
        lines.append(
            _row(
                f"of which `{name}`",
                "out of sample",
                kv_figures([c for c in result.clean if c.dataset == name]),
            )
        )
    for era in ERA_ORDER:
        mine = [c for c in result.clean if c.era == era]
        if mine:
            lines.append(_row(f"of which vLLM {era}", "out of sample", kv_figures(mine)))
    if result.leaked:
        lines.append(
            _row(
                "rows whose prediction uses a constant only their own source informs "
                "(kept out of the line above)",
                "not out of sample",
                kv_figures(result.leaked),
            )
        )
    lines.append(_row("development logs, built-in constants and bands", "in sample", ins))
    w = [c for c in weights if c.metric == "weights_gib"]
    w_med, w_p90 = stats(c.rel_err_pct for c in w)
    lines += [
        f"| weights GiB, every set (nothing fitted) | — | {len(w)} | "
        f"{w_med:.2f} % / {w_p90:.2f} % | — |",
        "",
        f"Targets out of sample: median ≤ {TARGET_MEDIAN} %, p90 ≤ {TARGET_P90} %, inside the "
        f"range ≥ {TARGET_COVERAGE:.0f} % at a median half-width ≤ {TARGET_HALF_WIDTH} %. "
        f"Each estimated term inside its band, the band derived without the log's source: "
        f"{_term_cells(result.terms)}. The shipped bands are what the procedure gives on every "
        f"log: {'yes' if bands_same else 'NO'}.",
    ]
    figures = {
        "loso_n": oos["n"],
        "loso_median": round(oos["median"], 2),
        "loso_p90": round(oos["p90"], 2),
        "loso_in_range": round(oos["in_range"], 1),
        "loso_half_width": round(oos["half_width"], 2),
        "in_sample_n": ins["n"],
        "in_sample_median": round(ins["median"], 2),
        "in_sample_p90": round(ins["p90"], 2),
    }
    return "\n".join(lines), figures


def _known_rows(dev_path: Path | None) -> set[str]:
    """Every development and held-out row, as canonical JSON."""
    paths = [*sorted((HERE / "data").glob(HOLDOUT_GLOB)), *([dev_path] if dev_path else [])]
    return {json.dumps(r, sort_keys=True) for p in paths for r in load_rows(p)}


def _read(path: Path) -> list[dict[str, Any]]:
    """The rows of a new set, or a one-line error naming the bad line."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as exc:
            raise accuracy_page.PageError(
                f"{path}:{number} is not JSON ({exc.msg}): one JSON object a line"
            ) from None
        if row is not None:
            rows.append(row)
    return rows


def ledger_cases(cases: list[Case]) -> list[dict[str, object]]:
    """The per-case figures a ledger row keeps (the KV cases)."""
    return [
        {
            "row": c.row,
            "model": c.model,
            "observed": c.observed,
            "predicted": c.predicted,
            "low": c.low,
            "high": c.high,
            "err": c.rel_err_pct,
        }
        for c in cases
        if c.metric == "kv_cache_gib"
    ]


def first_sight(path: Path, verbose: bool) -> int:
    """Score a new set once with the shipped constants and bands, and keep its dated row."""
    if not path.is_file():
        raise accuracy_page.PageError(f"{path} is not a file: pass the new set's JSON-lines file")
    rows = _read(path)
    seen = _known_rows(default_dev()) & {json.dumps(r, sort_keys=True) for r in rows}
    if seen:
        raise accuracy_page.PageError(
            f"{len(seen)} rows of {path} are already in the development or held-out data: "
            "it is not unseen, so it has no first sight"
        )
    cases, status = score_unseen(path, verbose)
    kept = ledger_cases(cases)
    if not kept:
        raise accuracy_page.PageError(f"no KV case of {path} was answered: nothing to keep")
    command = f"python bench/planner_accuracy.py --first-sight {path}"
    row = accuracy_page.append_row(
        {
            "face": "planner",
            "set": path.stem,
            "files": [str(path)],
            "sha256": accuracy_page.content_sha256([path]),
            "date": accuracy_page.today(),
            "commit": accuracy_page.commit(),
            "recorded_in": accuracy_page.commit(),
            "command": command,
            "summary": accuracy_page.planner_summary(kept),
            "cases": kept,
            "pooled": True,
            "note": f"{len(rows)} rows, {len(kept)} KV cases answered; scored once as it arrived",
        }
    )
    accuracy_page.write_headline()
    print(
        f"\nkept in {accuracy_page.LEDGER}: {row['summary']}; the headline of "
        f"{accuracy_page.PAGE} is refreshed. The set may now join the held-out data "
        f"(bench/data/startup-logs-{path.stem}.jsonl)."
    )
    return status


def main(argv: list[str] | None = None) -> int:
    """Score every log (or one file with ``--data``); 0 when every target is met."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dev", type=Path, default=None, help="development logs")
    ap.add_argument(
        "--holdout",
        type=Path,
        nargs="*",
        default=None,
        help=f"held-out sets (default: bench/data/{HOLDOUT_GLOB})",
    )
    ap.add_argument("--data", type=Path, help="score only this file, as unseen data")
    ap.add_argument("--first-sight", type=Path, help="score a new set once and keep its row")
    ap.add_argument("--write-docs", action="store_true", help="write the planner section")
    ap.add_argument("--bands", action="store_true", help="print the derived band table as code")
    ap.add_argument("--terms", action="store_true", help="list every term outside its band")
    ap.add_argument("--verbose", action="store_true", help="print every case")
    args = ap.parse_args(argv)
    try:
        if args.first_sight is not None:
            return first_sight(args.first_sight, args.verbose)
        if args.data is not None:
            return score_unseen(args.data, args.verbose)[1]
        return full_run(args)
    except accuracy_page.PageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def full_run(args: argparse.Namespace) -> int:
    """Every log out of sample, the shipped bands, in sample, weights; the page with
    ``--write-docs``."""
    started = time.perf_counter()
    dev_path = args.dev or default_dev()
    holdouts = (
        args.holdout if args.holdout is not None else sorted((HERE / "data").glob(HOLDOUT_GLOB))
    )
    dev, skipped = ([], []) if dev_path is None else prepare(load_rows(dev_path), "dev")
    held: list[Prepared] = []
    for path in holdouts:
        part, why = prepare(load_rows(path), path.stem)
        held += part
        skipped += why
    print(f"development logs: {dev_path or 'not found (pass --dev)'}")
    print(f"held-out sets: {', '.join(str(p) for p in holdouts) or 'none'}")
    # Every log with a KV figure is pooled: the held-out sets have informed the constants'
    # values and bands since they were first scored, so they are left out by source like the
    # rest, and each source is scored with constants and bands derived without it.
    pooled = dev + held
    sens = sensitivities(pooled)
    result = nested_loso(pooled, sens)
    _, refused = score(held)
    skipped += refused
    _report_skips(skipped, args.verbose)
    print()
    status = print_headline(result.clean)
    print_breakdown(result.clean)
    print_terms(result.terms, args.terms or args.verbose)
    print_leaked(result)
    print_cases(result.clean, args.verbose)
    same = print_bands(derive_fold_bands(pooled, sens, check_kv=True), args.bands)
    if not same:
        status = 1
    in_sample, _ = score(dev)
    print("\nIN SAMPLE (secondary) — development logs with the built-in constants and bands:")
    print(_line("dev", in_sample))
    unseen, _ = score(held)
    print_weights(in_sample + unseen)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.write_docs:
        body, figures = planner_markdown(result, in_sample, in_sample + unseen, same)
        accuracy_page.write_section(
            "planner", body, "python bench/planner_accuracy.py --write-docs", figures
        )
    return status


def score_unseen(path: Path, verbose: bool) -> tuple[list[Case], int]:
    """One file scored as unseen data with the built-in constants and bands: its cases, and 0
    when every target is met."""
    if not path.is_file():
        raise accuracy_page.PageError(
            f"{path} is not a file: pass a JSON-lines file of startup logs"
        )
    rows = _read(path)
    prepared, skipped = prepare(rows, path.stem)
    cases, refused = score(prepared)
    skipped += refused
    answered = len({c.row for c in cases if c.metric == "kv_cache_gib"})
    with_kv = sum(1 for r in rows if ((r.get("observed") or {}).get("kv_cache_gib") or 0) > 0)
    print(
        f"data: {path} — {len(rows)} rows, {answered} KV cases answered of {with_kv} with a "
        "positive KV figure"
    )
    _report_skips(skipped, verbose)
    print()
    if answered == 0:
        return cases, 1
    status = print_headline(cases)
    print_breakdown(cases)
    print_cases(cases, verbose)
    print_weights(cases)
    return cases, status


if __name__ == "__main__":
    sys.exit(main())
