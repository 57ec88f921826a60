"""Score `oomguard doctor` on real out-of-memory cases: top-1 cause, confusion matrix, and how
often the first fix matches the fix that worked.

Usage: python bench/doctor_accuracy.py [CASES.jsonl] [--log-only]

Each case is diagnosed twice: from its log alone, and from its log plus what the reporter
stated (model, GPU, settings) — the same facts a user passes with --model/--gpu/--command.
A first fix "matches" when it pulls the same lever in the same direction as the fix that
worked (e.g. lowering --gpu-memory-utilization; any CUDA-graph reduction; any quantized
checkpoint); cases without a recorded fix are not counted.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.findings import CAUSES, Fix
from oomguard.doctor.situation import Context
from oomguard.logs import parse_stream

DEFAULT_CASES = Path(__file__).resolve().parents[2] / "shared" / "data" / "oom-cases.jsonl"

# lever families: (regex over the fix that worked, family, direction)
_WORKED = (
    (
        r"(?:increase|raise|higher)\w*\s+(?:the\s+)?-*(?:vllm_)?gpu[_-]memory[_-]utili[sz]ation",
        "util",
        "up",
    ),
    (
        r"(?:reduce|lower|decrease)\w*\s+(?:the\s+)?-*(?:vllm_)?gpu[_-]memory[_-]utili[sz]ation"
        r"|-*gpu[_-]memory[_-]utili[sz]ation\s+(?:lowered|reduced|decreased)",
        "util",
        "down",
    ),
    (r"gpu[_-]memory[_-]utili[sz]ation\s+0\.\d+.*?(?:default|crashes|failed)", "util", "down"),
    (
        r"gpu[_-]memory[_-]utili[sz]ation\W+(?:\w+\W+){0,4}?(?:be\s+)?(?:raised|increased)",
        "util",
        "up",
    ),
    (
        r"max[_-]model[_-]len\s+\d+|max[_-](?:model|seq)[_-]len\s*=\s*\d+"
        r"|(?:smaller|shorter|lower|reduc|decreas|cap)\w*\s+(?:the\s+)?-*max[_-](?:model|seq)[_-]len"
        r"|explicit\w*\s+-*max[_-]model[_-]len|-*max[_-]model[_-]len\s+explicitly",
        "max_model_len",
        "down",
    ),
    (r"enforce[_-]eager|capture", "cuda_graph", "down"),
    (
        r"(?:reduce|lower|set(?:ting)?|smaller)\w*\s+(?:vllm\s+)?-*max[_-]num[_-]seqs|max[_-]num[_-]seqs\s*=?\s*\d+"
        r"|-*max[_-]num[_-]seqs\s+(?:lowered|reduced|decreased)",
        "max_num_seqs",
        "down",
    ),
    (r"max[_-]num[_-]batched[_-]tokens", "batched_tokens", "down"),
    (r"limit[_-]mm[_-]per[_-]prompt|max_pixels|mm[_-]processor[_-]kwargs", "mm_limits", "down"),
    (r"\bawq\b|\bgptq\b|quantiz", "quantize", "down"),
    (r"tensor[_-]parallel", "tp", "up"),
    (r"expandable_segments|PYTORCH_CUDA_ALLOC_CONF|TORCH_NCCL|torch==", "allocator_env", "change"),
    (
        r"isolate|kill|clean up|downgrade|stay on|install\w*\s+flash[ _-]?att|more\s+(?:host\s+|system\s+|cpu\s+)?ram\b"
        r"|free the previous|del llm|more resources",
        "action",
        "change",
    ),
    (r"swap", "swap", "change"),
)


# "--gpu-memory-utilization 0.9 (…)": the utilization the fix that worked set, when it opens with one
_WORKED_UTIL = re.compile(
    r"^\s*-*gpu[_-]memory[_-]utili[sz]ation[\s=]+(?P<util>0?\.\d+|1(?:\.0+)?)(?![\d.])"
)


def row_settings(row: dict[str, Any]) -> dict[str, Any]:
    """A case's reported settings as a mapping; a case that wrote them as free text (a pasted
    command, a remark) states none the scripts can read."""
    settings = row.get("settings")
    return settings if isinstance(settings, dict) else {}


def row_util(row: dict[str, Any]) -> float | None:
    """The utilization a case's reported settings state, when it is one number."""
    value = row_settings(row).get("gpu_memory_utilization")
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def worked_levers(text: str, current_util: float | None = None) -> set[tuple[str, str]]:
    """The (family, direction) levers a free-text "fix that worked" names.

    When the text opens with the utilization that worked and the case states the one that
    failed, the direction of the utilization lever is their comparison, not the wording.
    """
    levers = {
        (family, direction)
        for pattern, family, direction in _WORKED
        if re.search(pattern, text, re.IGNORECASE)
    }
    stated = _WORKED_UTIL.search(text)
    if stated and current_util is not None:
        value = float(stated.group("util"))
        if value != current_util:
            levers = {lever for lever in levers if lever[0] != "util"}
            levers.add(("util", "up" if value > current_util else "down"))
    return levers


def fix_lever(fix: Fix, current_util: float | None) -> tuple[str, str]:
    """The (family, direction) lever of one of our fixes."""
    flag = fix.flag
    if flag == "--gpu-memory-utilization":
        try:
            value = float(fix.value or "nan")
        except ValueError:
            return ("util", "change")
        base = current_util if current_util is not None else 0.9
        return ("util", "up" if value > base else "down")
    table = {
        "--max-model-len": ("max_model_len", "down"),
        "--max-num-seqs": ("max_num_seqs", "down"),
        "--max-num-batched-tokens": ("batched_tokens", "down"),
        "--limit-mm-per-prompt": ("mm_limits", "down"),
        "--mm-processor-kwargs": ("mm_limits", "down"),
        "--enforce-eager": ("cuda_graph", "down"),
        "--max-cudagraph-capture-size": ("cuda_graph", "down"),
        "--cudagraph-capture-sizes": ("cuda_graph", "down"),
        "--quantization": ("quantize", "down"),
        "--model": ("quantize", "down"),
        "--tensor-parallel-size": ("tp", "up"),
        "PYTORCH_CUDA_ALLOC_CONF": ("allocator_env", "change"),
        "TORCH_NCCL_AVOID_RECORD_STREAMS": ("allocator_env", "change"),
        "action": ("action", "change"),
        "--swap-space": ("swap", "change"),
    }
    return table.get(flag, (flag, "change"))


def context_of(row: dict[str, Any]) -> Context:
    settings = {k: v for k, v in row_settings(row).items() if v is not None}
    return Context(model=row.get("model"), gpu=row.get("gpu"), args=settings)


def score(rows: list[dict[str, Any]], with_context: bool) -> dict[str, Any]:
    confusion: Counter[tuple[str, str]] = Counter()
    correct = 0
    fix_total = fix_match = 0
    misses: list[str] = []
    for i, row in enumerate(rows):
        parsed = parse_stream(row["log"].splitlines())
        diagnosis = diagnose(parsed, context_of(row) if with_context else Context())
        top = diagnosis.top
        got = top.cause if top else "none"
        confusion[(row["label"], got)] += 1
        if got == row["label"]:
            correct += 1
        else:
            misses.append(f"  case {i}: {row['label']} → {got}   ({row['source']})")
        worked = row.get("fix_that_worked")
        if worked:
            levers = worked_levers(worked, row_util(row))
            if levers:
                fix_total += 1
                fixes = top.ordered_fixes() if top else []
                if fixes:
                    util = diagnosis.derived.get("gpu_memory_utilization", {}).get("value")
                    if fix_lever(fixes[0], util) in levers:
                        fix_match += 1
    return {
        "correct": correct,
        "n": len(rows),
        "confusion": confusion,
        "fix_total": fix_total,
        "fix_match": fix_match,
        "misses": misses,
    }


def print_confusion(confusion: Counter[tuple[str, str]]) -> None:
    labels = list(CAUSES)
    predicted = labels + ["none"]
    short = {c: c[:6] for c in predicted}
    print(f"{'label / predicted':<26}" + "".join(f"{short[c]:>7}" for c in predicted))
    for label in labels:
        row = [confusion.get((label, p), 0) for p in predicted]
        if sum(row):
            print(f"{label:<26}" + "".join(f"{n:>7}" if n else f"{'.':>7}" for n in row))


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("--")]
    path = Path(paths[0]) if paths else DEFAULT_CASES
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    modes = [False] if "--log-only" in argv else [False, True]
    print(f"doctor accuracy on {len(rows)} cases from {path}")
    for with_context in modes:
        start = time.perf_counter()
        result = score(rows, with_context)
        elapsed = time.perf_counter() - start
        title = "log + reported model/GPU/settings" if with_context else "log only"
        print(f"\n== {title} ==")
        print(
            f"top-1 cause: {result['correct']}/{result['n']} = {result['correct'] / result['n']:.1%}"
        )
        if result["fix_total"]:
            print(
                f"first fix matches the fix that worked: {result['fix_match']}/{result['fix_total']} = "
                f"{result['fix_match'] / result['fix_total']:.1%} (cases with a recorded fix)"
            )
        print(f"time: {elapsed * 1000 / result['n']:.1f} ms per case")
        print_confusion(result["confusion"])
        if result["misses"]:
            print("misses:")
            print("\n".join(result["misses"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
