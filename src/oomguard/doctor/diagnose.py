"""Entry points: a parsed log (plus what the user knows) → a :class:`Diagnosis`.

The decision has two tiers. The mechanism checks (``mechanisms.py``) run first: one that fires
with its numbers gives a sure answer, stated with the measured precision of that check. Else
the calibrated model (``model.py``) ranks the causes from the weaker signals; when its best
probability is below :data:`ABSTAIN_BELOW`, the doctor abstains: it lists the candidates it
cannot tell apart and the lines or facts that would settle it (``needs.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomguard.doctor.features import extract
from oomguard.doctor.findings import LABELS, Diagnosis, Finding
from oomguard.doctor.fixes import fixes_for
from oomguard.doctor.mechanisms import Verdict, run_mechanisms
from oomguard.doctor.model import CauseModel, load_model
from oomguard.doctor.needs import what_would_settle
from oomguard.doctor.not_memory import engine_fault
from oomguard.doctor.outcome import predicted_outcome, unaccounted_memory_note
from oomguard.doctor.situation import Context, Situation, build_situation
from oomguard.logs import Evidence, ParsedLog, parse_file

# Below this probability the ranking is a guess: the doctor abstains (exit code 4).
ABSTAIN_BELOW = 0.5
# Causes shown beside the answer: those at least this likely, at most MAX_FINDINGS in all.
SHOW_FROM = 0.05
MAX_FINDINGS = 4


def diagnose(
    parsed: ParsedLog, context: Context | None = None, *, model: CauseModel | None = None
) -> Diagnosis:
    """Name the root causes of the memory failure in ``parsed``, best first, with fixes.

    ``context`` carries what the log may lack (model, GPU, the original command line);
    ``model`` replaces the shipped cause model (evaluation trains its own). When the log shows
    no memory failure the diagnosis has ``oom_found=False`` and no findings; when it shows a
    failure that is not memory instead (a SIGILL, a missing kernel image, a driver older than
    the CUDA build, NCCL failing to initialise), ``not_memory`` names it with what to do.
    """
    context = context or Context()
    s = build_situation(parsed, context)
    # a stated failure that is not memory outweighs a traceback cut short in some phase
    fault = None if parsed.shows_failure else engine_fault(parsed)
    failed = parsed.shows_failure or (
        fault is None
        and parsed.has("truncated_traceback")
        and (parsed.failure_phase is not None or parsed.has("failing_in_mm_encoder"))
    )
    if not failed:
        return Diagnosis(
            findings=[],
            parsed=parsed,
            derived=_derived(s),
            oom_found=False,
            not_memory=fault,
        )
    model = model or load_model()
    verdicts = run_mechanisms(s)
    probabilities = model.probabilities(extract(s, verdicts))
    findings = _decide(s, verdicts, probabilities, model)
    note = unaccounted_memory_note(s)
    if note:
        findings[0].explanation = f"{findings[0].explanation} {note}".strip()
    abstained = not findings[0].sure and findings[0].confidence < ABSTAIN_BELOW
    needs = what_would_settle(s, [f.cause for f in findings[:3]]) if not findings[0].sure else []
    return Diagnosis(
        findings=findings,
        parsed=parsed,
        derived=_derived(s),
        plan=predicted_outcome(s, findings[0].fixes[0]) if findings[0].fixes else None,
        oom_found=True,
        abstained=abstained,
        needs=needs,
        probabilities=probabilities,
    )


def diagnose_file(path: str | Path, context: Context | None = None) -> Diagnosis:
    """Parse the log at ``path`` (``-`` for stdin) in bounded memory and diagnose it.

    Raises :class:`~oomguard.errors.BadInput` for a missing or unreadable file.
    """
    return diagnose(parse_file(path), context)


def sure_confidence(verdict: Verdict, model: CauseModel) -> float:
    """How often this check's answer was right in the labelled corpus: (hits + 2·p) / (n + 2),
    with p the precision of all checks together (a check seldom seen leans on the others)."""
    table = model.meta.get("mechanisms", {})
    pooled = model.meta.get("mechanisms_pooled", [0, 0])
    prior = (pooled[0] + 1) / (pooled[1] + 2)
    hits, n = table.get(f"{verdict.mechanism}:{verdict.cause}", [0, 0])
    return float((hits + 2 * prior) / (n + 2))


def _decide(
    s: Situation, verdicts: list[Verdict], probabilities: dict[str, float], model: CauseModel
) -> list[Finding]:
    findings: list[Finding] = []
    rest = dict(probabilities)
    if verdicts:
        # several checks may fire (an OOM in weight loading on a GPU another process fills):
        # the model's ranking orders them, the checks' precedence breaks ties
        verdict = max(verdicts, key=lambda v: probabilities.get(v.cause, 0.0))
        confidence = sure_confidence(verdict, model)
        findings.append(_sure_finding(s, verdict, confidence))
        left = 1.0 - rest.pop(verdict.cause, 0.0)
        rest = {c: p * (1.0 - confidence) / left for c, p in rest.items()} if left > 0 else {}
    values = extract(s, [])
    for cause, p in rest.items():
        if len(findings) >= MAX_FINDINGS or (findings and p < SHOW_FROM):
            break
        findings.append(_ranked_finding(s, cause, p, model, values))
    return findings


def _sure_finding(s: Situation, verdict: Verdict, confidence: float) -> Finding:
    return Finding(
        cause=verdict.cause,
        confidence=confidence,
        summary=verdict.summary,
        evidence=list(verdict.evidence),
        fixes=fixes_for(s, verdict.cause, verdict),
        explanation=verdict.explanation,
        sure=True,
        mechanism=verdict.mechanism,
        numbers=dict(verdict.numbers),
    )


def _ranked_finding(
    s: Situation, cause: str, p: float, model: CauseModel, values: dict[str, float]
) -> Finding:
    cues = [c for name in model.contributions(values, cause, top=8) if (c := _cue_text(name))][:4]
    summary = LABELS[cause] + (f" (the log shows {', '.join(cues)})" if cues else "")
    return Finding(
        cause=cause,
        confidence=p,
        summary=summary,
        evidence=_evidence_lines(s),
        fixes=fixes_for(s, cause, None),
        explanation="Ranked by the calibrated model from the signals the log holds; no "
        "mechanism check could prove a cause with numbers.",
    )


def _cue_text(feature: str) -> str | None:
    """How a feature that pushed a cause up reads in a summary (None: not worth saying)."""
    kind, _, name = feature.partition(":")
    if kind == "sig" and name.startswith("said_"):
        return "words about " + name.removeprefix("said_").replace("_", " ")
    words = name.replace("_", " ")
    if kind == "sig":
        return words
    if kind == "phase" and name != "none":
        return f"a failure during {words}"
    if kind == "oom":
        return "several out-of-memory errors" if name == "several" else f"a {words} OOM"
    if kind in ("util", "oom_tried", "oom_own", "max_model_len", "max_num_seqs"):
        return f"{kind.replace('_', ' ')} {words}"
    return None


def _evidence_lines(s: Situation) -> list[Evidence]:
    p = s.parsed
    lines = [o.evidence for o in p.ooms[:2]]
    if p.failure_phase is not None:
        lines.append(p.failure_phase.evidence)
    for name in ("kv_too_small", "no_cache_blocks", "startup_check_failed", "said_oom"):
        if name in p.signatures:
            lines.append(p.signatures[name])
    lines.extend(p.errors[:2])
    unique = {ev.line: ev for ev in reversed(lines)}
    return sorted(unique.values(), key=lambda ev: ev.line)[:4]


def _derived(s: Situation) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in (
        "model",
        "gpu_name",
        "gpu_total_gib",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "weights_per_gpu_gib",
        "weights_total_gib",
        "max_model_len",
        "max_num_seqs",
        "vllm_version",
        "engine",
    ):
        known = s.known(name)
        if known is None:
            continue
        value = round(known.value, 3) if isinstance(known.value, float) else known.value
        out[name] = {"value": value, "from": known.origin}
    out["block_size"] = s.block_size
    out["sleep_mode"] = s.sleep_mode
    return out
