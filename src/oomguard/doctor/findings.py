"""Findings, fixes and the diagnosis value the CLI renders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oomguard.doctor.not_memory import EngineFault
from oomguard.logs.parsed import Evidence, ParsedLog

CAUSES = (
    "util_overshoot",
    "kv_too_small_for_max_len",
    "concurrency_or_batch",
    "weights_dont_fit",
    "cuda_graph",
    "fragmentation",
    "multimodal_encoder",
    "leak_or_other_process",
    "cpu_ram",
    "other",
)

LABELS = {
    "util_overshoot": "GPU memory utilization overshoot",
    "kv_too_small_for_max_len": "KV cache too small for max_model_len",
    "concurrency_or_batch": "too many sequences / too large a batch",
    "weights_dont_fit": "the weights do not fit",
    "cuda_graph": "CUDA-graph capture",
    "fragmentation": "allocator fragmentation",
    "multimodal_encoder": "multimodal encoder profiling",
    "leak_or_other_process": "leak or another process",
    "cpu_ram": "host RAM",
    "other": "other",
}


@dataclass(frozen=True)
class Fix:
    """One concrete change: a vLLM flag (``--max-model-len``), an environment variable
    (``PYTORCH_CUDA_ALLOC_CONF``) or an ``action`` to take, with the value and the reason.

    A flag fix may carry companion flags (``also``) that belong to the same change; a flag
    whose ``value`` is None is a switch (``--enforce-eager``).
    """

    flag: str
    value: str | None
    why: str
    also: tuple[tuple[str, str | None], ...] = ()

    @property
    def is_flag(self) -> bool:
        """Whether this is a vLLM command-line change (not an environment variable or action)."""
        return self.flag.startswith("--")

    @property
    def is_env(self) -> bool:
        """Whether this sets an environment variable."""
        return not self.is_flag and self.flag != "action"

    def flags(self) -> dict[str, str | None]:
        """The vLLM flags this fix sets, ``{"--max-model-len": "7168"}`` (empty for an action
        or an environment variable)."""
        if not self.is_flag:
            return {}
        return {self.flag: self.value, **dict(self.also)}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"flag": self.flag, "value": self.value, "why": self.why}
        if self.also:
            out["also"] = [{"flag": f, "value": v} for f, v in self.also]
        return out

    @property
    def as_text(self) -> str:
        if self.flag == "action":
            return str(self.value)
        if self.is_flag:
            return " ".join(
                flag if value in (None, "") else f"{flag} {value}"
                for flag, value in self.flags().items()
            )
        return f"{self.flag}={self.value}"


@dataclass
class Finding:
    """A root cause with its confidence (0–1), evidence lines, explanation and fixes.

    ``sure`` marks an answer a mechanism check proved with the numbers in ``numbers``
    (``mechanism`` names the check); otherwise the confidence is the calibrated model's
    probability. ``fixes`` are in the order to try them: the first one is the change to make.
    """

    cause: str
    confidence: float
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    explanation: str = ""
    sure: bool = False
    mechanism: str | None = None
    numbers: dict[str, float] = field(default_factory=dict)

    def ordered_fixes(self) -> list[Fix]:
        """The fixes in the order to try them."""
        return list(self.fixes)

    def flag_changes(self) -> dict[str, str | None]:
        """The vLLM flags of the first fix, ``{"--max-model-len": "7168"}``; empty when the
        first fix is not a flag change (an action to take, an environment variable), so a
        caller that applies it never applies a later, unsized fix instead."""
        return self.fixes[0].flags() if self.fixes else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "confidence": round(self.confidence, 2),
            "sure": self.sure,
            "mechanism": self.mechanism,
            "summary": self.summary,
            "explanation": self.explanation,
            "numbers": {k: round(v, 4) for k, v in self.numbers.items()},
            "evidence": [e.to_dict() for e in _dedupe(self.evidence)],
            "fixes": [f.to_dict() for f in self.fixes],
        }


def _dedupe(evidence: list[Evidence]) -> list[Evidence]:
    seen: set[int] = set()
    out: list[Evidence] = []
    for ev in sorted(evidence, key=lambda e: e.line):
        if ev.line not in seen:
            seen.add(ev.line)
            out.append(ev)
    return out


@dataclass(frozen=True)
class Need:
    """A line or fact the log lacks that would tell the candidate causes apart."""

    what: str
    how: str
    settles: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "how": self.how, "settles": list(self.settles)}


@dataclass
class Diagnosis:
    """The doctor's answer: findings best first, the parsed log, and the derived numbers.

    ``abstained`` is True when an out-of-memory failure was found but no cause reached the
    confidence the doctor answers at: ``findings`` then hold the candidates it cannot tell
    apart (best first) and ``needs`` what would settle it. ``not_memory`` names a failure the
    log shows that is not memory (an illegal instruction, a missing kernel image …), set when
    the log shows no memory failure.
    """

    findings: list[Finding]
    parsed: ParsedLog
    derived: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    oom_found: bool = True
    abstained: bool = False
    needs: list[Need] = field(default_factory=list)
    probabilities: dict[str, float] = field(default_factory=dict)
    not_memory: EngineFault | None = None

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    @property
    def sure(self) -> bool:
        """Whether the top finding is proved by a mechanism check."""
        return self.top is not None and self.top.sure

    def to_dict(self) -> dict[str, Any]:
        return {
            "oom_found": self.oom_found,
            "not_memory": self.not_memory.to_dict() if self.not_memory else None,
            "abstained": self.abstained,
            "sure": self.sure,
            "findings": [f.to_dict() for f in self.findings],
            "needs": [n.to_dict() for n in self.needs],
            "probabilities": {k: round(v, 4) for k, v in self.probabilities.items()},
            "derived": self.derived,
            "plan": self.plan,
            "parsed": self.parsed.to_dict(),
        }
